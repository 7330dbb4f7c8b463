#pragma once
// Each subcommand registers its flags on the root app and returns how to run it once parsed.

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace capsnet::cli {

struct Subcommand {
  CLI::App* app = nullptr;
  std::function<int()> run;  // exit status
};

Subcommand add_train(CLI::App& root);
Subcommand add_eval(CLI::App& root);
Subcommand add_predict(CLI::App& root);
Subcommand add_reconstruct(CLI::App& root);
Subcommand add_perturb(CLI::App& root);
Subcommand add_bench(CLI::App& root);
Subcommand add_ablation(CLI::App& root);
Subcommand add_report(CLI::App& root);
Subcommand add_multimnist(CLI::App& root);
Subcommand add_affine(CLI::App& root);
Subcommand add_export(CLI::App& root);
Subcommand add_serve(CLI::App& root);
Subcommand add_segcaps(CLI::App& root);
Subcommand add_stn(CLI::App& root);
Subcommand add_em(CLI::App& root);

/// Flags shared by the subcommands that compute: --threads.
void add_threads_flag(CLI::App& app, int& threads);

/// Writes `text` to `path` (replacing it); throws std::runtime_error naming the path when it cannot
/// be opened or written, so that no command reports a result file it failed to write.
void write_text_file(const std::string& path, const std::string& text);

/// Which image set a command reads: --dataset mnist|fashion-mnist picks the default directory,
/// --data DIR overrides it. Both sets are the same four IDX files (plain or .gz).
struct DataFlags {
  std::string dataset = "mnist";
  std::string dir;  // empty: the dataset's default directory
  /// The directory to read: --data if given, else the dataset's default (data/mnist or
  /// /usr/share/datasets/fashion-mnist).
  std::string resolved() const;
};

/// Registers --dataset and --data on `app`, writing into `flags`.
void add_data_flags(CLI::App& app, DataFlags& flags);

}  // namespace capsnet::cli
