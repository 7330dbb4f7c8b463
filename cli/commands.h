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

}  // namespace capsnet::cli
