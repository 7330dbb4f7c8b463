// Placeholder: registered so that the command table is stable while the command is being written.
#include <stdexcept>

#include "cli/commands.h"

namespace capsnet::cli {

Subcommand add_em(CLI::App& root) {
  auto* app = root.add_subcommand("em", "Matrix capsules with EM routing: train and evaluate on MNIST or Fashion-MNIST (not implemented yet)");
  return {app, []() -> int { throw std::runtime_error("capsnet em is not implemented yet"); }};
}

}  // namespace capsnet::cli
