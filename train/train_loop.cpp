#include "train/train_loop.h"

#include <chrono>
#include <cmath>
#include <cstdio>

namespace laplace {

namespace {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Status TrainLoop::run(TrainProgress* progress) const {
  const double t_start = now_s();
  for (int64_t step = progress->step; step < steps; ++step) {
    const double t0 = now_s();
    double loss = 0;
    const StepResult r = this->step(step, &loss);
    const double dt = now_s() - t0;

    progress->step = step + 1;
    progress->optimizer_steps = optimizer_steps();
    progress->tokens_seen += static_cast<double>(tokens_per_step);
    StepLog s;
    s.step = step;
    s.loss = loss;
    s.lr = lr_at(schedule, step);
    s.grad_norm = r.grad_norm;
    s.skipped = r.skipped;
    s.tokens_per_s = static_cast<double>(tokens_per_step) / dt;
    s.flops_per_s = s.tokens_per_s * flops_per_token;
    s.mfu = peak_flops > 0 ? s.flops_per_s / peak_flops : 0;
    s.elapsed_s = now_s() - t_start;
    if (r.skipped && talk)
      std::fprintf(stderr, "laplace: step %lld: gradient norm is not finite; step skipped, optimizer state untouched\n",
                   (long long)(step + 1));
    record(s);

    if (eval_every > 0 && has_val && (step + 1) % eval_every == 0) {
      double vl;
      LAPLACE_RETURN_IF_ERROR(validate(&vl));
      if (talk)
        std::printf("step %5lld/%lld | val loss %.4f | val ppl %.2f\n", (long long)(step + 1), (long long)steps, vl,
                    std::exp(vl));
      record_validation(step, vl);
    }
    if (stop_after > 0 && step + 1 >= stop_after && step + 1 < steps) {
      if (talk) std::printf("stopping after step %lld as asked; resume with --resume\n", (long long)(step + 1));
      break;
    }
    if (ckpt_every > 0 && (step + 1) % ckpt_every == 0 && step + 1 < steps) LAPLACE_RETURN_IF_ERROR(save_checkpoint());
  }
  return save_checkpoint();
}

}  // namespace laplace
