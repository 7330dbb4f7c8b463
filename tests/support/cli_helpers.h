#pragma once
// Helpers for the tests that drive the `capsnet` binary built beside them (CAPSNET_CLI).

#include <gtest/gtest.h>

#include <string>

#include "test_helpers.h"

namespace capsnet::testing {

/// `capsnet <args>`: exit status and combined output.
inline CommandResult run_cli(const std::string& args) { return run_command(std::string(CAPSNET_CLI) + " " + args); }

/// Passes when the command failed (non-zero status) and its output says `what`; otherwise shows the output.
inline ::testing::AssertionResult FailsSaying(const CommandResult& r, const std::string& what) {
  if (r.status == 0) return ::testing::AssertionFailure() << "the command succeeded:\n" << r.output;
  if (r.output.find(what) == std::string::npos)
    return ::testing::AssertionFailure() << "the command failed without saying \"" << what << "\":\n" << r.output;
  return ::testing::AssertionSuccess();
}

/// A temporary folder for command-line runs: `data` is where the caller writes an MNIST directory, `out`
/// the run's output folder.
struct CliFolder {
  TempDir dir;
  const std::string data = dir / "mnist";
  const std::string out;

  explicit CliFolder(const std::string& out_name = "out") : out(dir / out_name) {}

  /// `capsnet <command> --data <data> --out <out> <args> --no-progress --threads 1`.
  CommandResult run(const std::string& command, const std::string& args) const { return run_to(out, command, args); }
  /// The same with another output folder.
  CommandResult run_to(const std::string& out_dir, const std::string& command, const std::string& args) const {
    return run_cli(command + " --data " + data + " --out " + out_dir + " " + args + " --no-progress --threads 1");
  }
};

}  // namespace capsnet::testing
