// Placeholder: registered so that the command table is stable while the command is being written.
#include <stdexcept>

#include "cli/commands.h"

namespace capsnet::cli {

Subcommand add_export(CLI::App& root) {
  auto* app = root.add_subcommand("export", "Export a checkpoint's weights for Python (torch::pickle_save, read by torch.load) (not implemented yet)");
  return {app, []() -> int { throw std::runtime_error("capsnet export is not implemented yet"); }};
}

}  // namespace capsnet::cli
