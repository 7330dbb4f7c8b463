// Placeholder: registered so that the command table is stable while the command is being written.
#include <stdexcept>

#include "cli/commands.h"

namespace capsnet::cli {

Subcommand add_stn(CLI::App& root) {
  auto* app = root.add_subcommand("stn", "Distorted-MNIST experiment: CapsNet/CNN with and without a spatial transformer (not implemented yet)");
  return {app, []() -> int { throw std::runtime_error("capsnet stn is not implemented yet"); }};
}

}  // namespace capsnet::cli
