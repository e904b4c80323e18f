// BenchLog: one JSON line per benchmark figure, printed and appended to a results
// file (bench/results.jsonl), in the form BENCHMARKS.md's tables are built from:
// {"bench": NAME, "value": X, "unit": U, "device": …, "commit": …, "date": …, "note": …}
// and, when `command` is set, "command": the command line that measured it.
#pragma once

#include <string>
#include <vector>

namespace laplace {

struct BenchLog {
  std::string path;    // results file; empty = print only
  std::string device;  // e.g. "NVIDIA H200"
  std::string commit;  // see commit_hash()
  std::string date;    // see iso_date_utc()
  std::string tag;     // appended to every name as "_tag" when not empty
  std::string note;    // how the figure was measured
  std::string command; // the command line that produced it (command_line()); empty: not written

  void add(const std::string& name, double value, const std::string& unit) const { add(name, value, unit, note); }
  void add(const std::string& name, double value, const std::string& unit, const std::string& note) const;

  // "2026-11-30T14:02:41Z"
  static std::string iso_date_utc();
  // `given` if set, else $LAPLACE_COMMIT, else the working tree's commit (`git describe --always
  // --dirty`: "-dirty" when tracked files differ from it, so a figure from an uncommitted or
  // copied tree is not filed under a commit it did not run), else "unknown".
  static std::string commit_hash(const std::string& given = "");
  // This process's command line from /proc/self/cmdline, arguments joined by spaces (those
  // with spaces or quotes single-quoted); empty where it cannot be read.
  static std::string command_line();
};

// The median of timings (the mean of the middle two for an even count; 0 for none): what
// the benchmark programs report per figure.
double bench_median(std::vector<double> v);
// The p-th percentile by nearest rank (the smallest value with at least p % of them at or
// below it; 0 for none): the latency percentiles of the serving benchmarks.
double bench_percentile(std::vector<double> v, double p);

}  // namespace laplace
