#include "serve/metrics.h"

#include <unistd.h>

#include <cstdio>

namespace laplace {

Histogram::Histogram(std::string name, std::string help, std::vector<double> bounds)
    : name_(std::move(name)), help_(std::move(help)), bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  std::lock_guard<std::mutex> lk(mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string* out) const {
  std::lock_guard<std::mutex> lk(mu_);
  char buf[256];
  *out += "# HELP " + name_ + " " + help_ + "\n# TYPE " + name_ + " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    std::snprintf(buf, sizeof buf, "%s_bucket{le=\"%g\"} %llu\n", name_.c_str(), bounds_[i], (unsigned long long)cum);
    *out += buf;
  }
  cum += counts_.back();
  std::snprintf(buf, sizeof buf, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.9g\n%s_count %llu\n", name_.c_str(),
                (unsigned long long)cum, name_.c_str(), sum_, name_.c_str(), (unsigned long long)count_);
  *out += buf;
}

std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

void render_metric(std::string* out, const std::string& name, const std::string& type, const std::string& help,
                   double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", value);
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + buf + "\n";
}

int64_t process_resident_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace laplace
