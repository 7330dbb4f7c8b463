// Output safety shared by the commands: a run folder holding a previous run is not silently
// replaced, and no command writes its output over one of its inputs.
#include <fmt/format.h>

#include <filesystem>
#include <stdexcept>

#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace fs = std::filesystem;

void add_overwrite_flag(CLI::App& app, bool& overwrite) {
  app.add_flag("--overwrite", overwrite,
               "Replace a previous run in --out (its checkpoint.pt and metrics.jsonl); without it such a folder is "
               "refused");
}

void check_run_dir(const std::string& out_dir, const std::string& resume_from, bool overwrite, bool can_resume,
                   const std::vector<std::string>& run_files) {
  if (overwrite) return;
  std::error_code same_error;
  const auto own = fs::path(out_dir) / "checkpoint.pt";
  // Resuming the folder's own run continues it; resuming another run into a folder that holds a run
  // would replace that run's checkpoint and metrics like a fresh start does.
  if (!resume_from.empty() && fs::exists(own, same_error) && fs::equivalent(resume_from, own, same_error)) return;
  std::string found;
  for (const auto& name : run_files) {
    std::error_code ec;
    const auto p = fs::path(out_dir) / name;
    if (fs::exists(p, ec) && !(fs::is_regular_file(p, ec) && fs::file_size(p, ec) == 0))
      found += (found.empty() ? "" : ", ") + name;
  }
  if (found.empty()) return;
  if (!resume_from.empty())
    throw std::invalid_argument(fmt::format(
        "--out {} holds another run ({}) and --resume {} is not its checkpoint: resuming there would replace it; "
        "choose another --out, or replace that run with --overwrite",
        out_dir, found, resume_from));
  throw std::invalid_argument(fmt::format(
      "--out {} holds a previous run ({}): {}replace it with --overwrite, or choose another --out", out_dir, found,
      can_resume ? fmt::format("continue it with --resume {}/checkpoint.pt, ", out_dir) : std::string()));
}

void check_not_an_input(const std::string& out, const std::vector<std::string>& inputs) {
  for (const auto& in : inputs) {
    std::error_code ec;
    if (!in.empty() && fs::exists(out, ec) && fs::equivalent(out, in, ec))
      throw std::invalid_argument(fmt::format("--out {} is the input {} itself: choose another output path", out, in));
  }
}

}  // namespace capsnet::apps::cli
