#include "train/run_record.h"

#include <cmath>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "train/trainer.h"

namespace laplace {

namespace {

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[64];
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(t / 3600), (long long)(t % 3600 / 60));
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(t / 60), (long long)(t % 60));
  else std::snprintf(buf, sizeof buf, "%llds", (long long)t);
  return buf;
}

}  // namespace

Status RunRecord::open(const TrainOptions& o, int64_t first_step, bool writer) {
  writer_ = writer;
  quiet_ = o.quiet || !writer;
  metrics_path_ = writer && !o.out_dir.empty() ? o.out_dir + "/metrics.jsonl" : "";
  first_step_ = first_step;
  steps_ = o.steps;
  log_every_ = std::max<int64_t>(1, o.log_every);
  peak_flops_ = o.peak_flops;
  if (writer && !o.tensorboard_dir.empty()) {
    // A new file per process; its START tells TensorBoard to drop older points from here on.
    LAPLACE_RETURN_IF_ERROR(tensorboard_.open(o.tensorboard_dir));
    LAPLACE_RETURN_IF_ERROR(tensorboard_.write_session_start(first_step));
  }
  return Status::ok();
}

void RunRecord::append(const std::string& line) {
  if (metrics_path_.empty()) return;
  std::ofstream f(metrics_path_, std::ios::app);
  f << line << "\n";
}

void RunRecord::scalars(int64_t step, const std::vector<ScalarValue>& values) {
  if (!tensorboard_.is_open()) return;
  const Status st = tensorboard_.write_scalars(step, values);
  if (st.is_ok()) return;
  std::fprintf(stderr, "laplace: %s; no more TensorBoard output\n", st.to_string().c_str());
  (void)tensorboard_.close();  // best effort: the writer already failed and was reported
}

void RunRecord::step(const StepLog& s, const std::string& extra, const std::string& detail) {
  if (!writer_) return;
  nlohmann::ordered_json j;
  j["step"] = s.step;
  j["loss"] = s.loss;
  j["lr"] = s.lr;
  j["grad_norm"] = s.grad_norm;
  j["tokens_per_s"] = s.tokens_per_s;
  j["flops_per_s"] = s.flops_per_s;
  if (peak_flops_ > 0) j["mfu"] = s.mfu;
  j["elapsed_s"] = s.elapsed_s;
  j["skipped"] = s.skipped;
  if (!extra.empty()) {
    const nlohmann::ordered_json more = nlohmann::ordered_json::parse(extra);
    for (const auto& [k, v] : more.items()) j[k] = v;
  }
  append(j.dump());
  std::vector<ScalarValue> tb = {
      {"loss", s.loss}, {"lr", s.lr}, {"grad_norm", s.grad_norm}, {"tokens_per_s", s.tokens_per_s}};
  if (peak_flops_ > 0) tb.push_back({"mfu", s.mfu});
  scalars(s.step, tb);
  if (quiet_ || (s.step % log_every_ != 0 && s.step + 1 != steps_)) return;
  const double per_step = s.elapsed_s / static_cast<double>(s.step + 1 - first_step_);
  char mfu[32] = "";
  if (peak_flops_ > 0) std::snprintf(mfu, sizeof mfu, " | mfu %.1f%%", 100.0 * s.mfu);
  std::printf("step %5lld/%lld | loss %.4f | lr %.3e | grad norm %.4f | %.0f tok/s | %.2f GFLOP/s%s%s | eta %s%s\n",
              (long long)(s.step + 1), (long long)steps_, s.loss, s.lr, s.grad_norm, s.tokens_per_s,
              s.flops_per_s / 1e9, mfu, detail.c_str(),
              fmt_duration(per_step * static_cast<double>(steps_ - s.step - 1)).c_str(),
              s.skipped ? " | SKIPPED (non-finite gradient)" : "");
  std::fflush(stdout);
}

void RunRecord::validation(int64_t step, double loss) {
  if (!writer_) return;
  append(val_loss_record(step, loss));
  scalars(step, {{"val_loss", loss}});
}

}  // namespace laplace
