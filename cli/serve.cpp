// Placeholder: registered so that the command table is stable while the command is being written.
#include <stdexcept>

#include "cli/commands.h"

namespace capsnet::cli {

Subcommand add_serve(CLI::App& root) {
  auto* app = root.add_subcommand("serve", "Local web viewer: draw a digit, see capsule lengths, tweak the pose, follow training (not implemented yet)");
  return {app, []() -> int { throw std::runtime_error("capsnet serve is not implemented yet"); }};
}

}  // namespace capsnet::cli
