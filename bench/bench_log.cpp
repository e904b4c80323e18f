#include "bench/bench_log.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

namespace laplace {

void BenchLog::add(const std::string& name, double value, const std::string& unit, const std::string& how) const {
  nlohmann::ordered_json j;
  j["bench"] = tag.empty() ? name : name + "_" + tag;
  j["value"] = std::isfinite(value) ? value : 0.0;
  j["unit"] = unit;
  j["device"] = device;
  j["commit"] = commit;
  j["date"] = date;
  j["note"] = how;
  if (!command.empty()) j["command"] = command;
  const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::printf("%s\n", line.c_str());
  if (path.empty()) return;
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream f(path, std::ios::app);
  if (!f) {
    std::fprintf(stderr, "laplace: cannot append benchmark results to %s\n", path.c_str());
    return;
  }
  f << line << "\n";
}

std::string BenchLog::iso_date_utc() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string BenchLog::commit_hash(const std::string& given) {
  if (!given.empty()) return given;
  if (const char* e = std::getenv("LAPLACE_COMMIT"); e && *e) return e;
  std::string out;
  if (FILE* p = popen("git describe --always --dirty --abbrev=7 2>/dev/null", "r")) {
    char buf[64];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r' || out.back() == ' ')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

std::string BenchLog::command_line() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::string out, arg;
  auto flush = [&] {
    if (!out.empty()) out += ' ';
    if (arg.find_first_of(" \t'\"") == std::string::npos && !arg.empty()) {
      out += arg;
    } else {
      out += '\'';
      for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
    arg.clear();
  };
  for (char c : all) {
    if (c == '\0') flush();
    else arg += c;
  }
  if (!arg.empty()) flush();
  return out;
}

double bench_median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double bench_percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t k = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(k, 1, v.size()) - 1];
}

}  // namespace laplace
