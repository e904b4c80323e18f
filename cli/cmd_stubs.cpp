// Subcommands whose implementations land with the training work.
#include "cli/common.h"

namespace laplace::cli {
void add_eval(CLI::App&) {}
void add_train(CLI::App&) {}
void add_tokenizer(CLI::App&) {}
void add_data(CLI::App&) {}
}  // namespace laplace::cli
