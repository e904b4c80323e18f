// laplace: train and serve fixed-state linear-attention language models.
#include <cstdio>

#include "cli/common.h"

int main(int argc, char** argv) {
  // Line-buffered stdout even into a pipe, so a run cut short (a timeout around a
  // benchmark) still leaves every finished line in its log.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"laplace: train and serve Laplace (gated linear attention) language models"};
  app.require_subcommand(1);
  laplace::cli::add_info(app);
  laplace::cli::add_init(app);
  laplace::cli::add_quantize(app);
  laplace::cli::add_forward(app);
  laplace::cli::add_generate(app);
  laplace::cli::add_eval(app);
  laplace::cli::add_train(app);
  laplace::cli::add_tokenizer(app);
  laplace::cli::add_data(app);
  laplace::cli::add_debug(app);
  laplace::cli::add_bench(app);
  laplace::cli::add_dist(app);
  laplace::cli::add_serve(app);
  laplace::cli::add_export(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0; a malformed command line exits 2 (errors in the work exit 1).
    return app.exit(e) == 0 ? 0 : 2;
  }
  return laplace::cli::g_exit_code;
}
