// Prometheus text-format metrics for the server (/metrics): counters, gauges and
// histograms with fixed buckets. Thread-safe; rendering takes a consistent snapshot.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "core/thread_annotations.h"

namespace laplace {

class Histogram {
 public:
  Histogram(std::string name, std::string help, std::vector<double> bounds);
  void observe(double v);
  // Appends "# HELP", "# TYPE" and the _bucket / _sum / _count lines.
  void render(std::string* out) const;

 private:
  std::string name_, help_;
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_ GUARDED_BY(mu_);  // per bucket (not cumulative); last = +Inf
  double sum_ GUARDED_BY(mu_) = 0;
  uint64_t count_ GUARDED_BY(mu_) = 0;
};

// Latency buckets in seconds, 1 ms … 60 s.
std::vector<double> latency_buckets();

// One "# HELP / # TYPE / value" block.
void render_metric(std::string* out, const std::string& name, const std::string& type, const std::string& help,
                   double value);

// Resident set size of this process in bytes (0 if unknown).
int64_t process_resident_bytes();

}  // namespace laplace
