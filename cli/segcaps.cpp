// Placeholder: registered so that the command table is stable while the command is being written.
#include <stdexcept>

#include "cli/commands.h"

namespace capsnet::cli {

Subcommand add_segcaps(CLI::App& root) {
  auto* app = root.add_subcommand("segcaps", "Train and evaluate a SegCaps-style capsule segmentation model on MNIST digit masks (Dice) (not implemented yet)");
  return {app, []() -> int { throw std::runtime_error("capsnet segcaps is not implemented yet"); }};
}

}  // namespace capsnet::cli
