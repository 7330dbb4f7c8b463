// capsnet: command-line tool. Subcommands are listed in kCommands; each lives in its own file.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include <iostream>
#include <vector>

#include "capsnet/data/idx.h"
#include "capsnet/train/checkpoint.h"
#include "apps/runtime.h"
#include "capsnet/train/trainer.h"
#include "capsnet/viz/png.h"
#include "apps/cli/commands.h"

namespace {
constexpr int kExitError = 1;

// The message without the backtrace or the "Exception raised from" trailer LibTorch appends.
std::string first_line(std::string what) {
  for (const char* marker : {"\nException raised from", "\nframe #"})
    if (auto pos = what.find(marker); pos != std::string::npos) what.resize(pos);
  while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
  return what;
}
constexpr int kExitDiverged = 3;
}  // namespace

int main(int argc, char** argv) {
  capsnet::apps::configure_runtime(argc, argv);
  CLI::App app{"capsnet: capsule networks (Sabour, Frosst & Hinton 2017) in C++ on LibTorch"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "capsnet 0.1.0");

  const std::vector<capsnet::apps::cli::Subcommand> commands = {
      capsnet::apps::cli::add_train(app),      capsnet::apps::cli::add_eval(app),     capsnet::apps::cli::add_predict(app),
      capsnet::apps::cli::add_reconstruct(app), capsnet::apps::cli::add_perturb(app),  capsnet::apps::cli::add_multimnist(app),
      capsnet::apps::cli::add_affine(app),     capsnet::apps::cli::add_ablation(app), capsnet::apps::cli::add_bench(app),
      capsnet::apps::cli::add_report(app),     capsnet::apps::cli::add_export(app),   capsnet::apps::cli::add_serve(app),
      capsnet::apps::cli::add_segcaps(app),    capsnet::apps::cli::add_stn(app),      capsnet::apps::cli::add_em(app),
      capsnet::apps::cli::add_folder(app),    capsnet::apps::cli::add_capspix2pix(app)};

  capsnet::apps::cli::apply_numeric_limits(app);
  bool verbose = false;
  app.add_flag("--verbose", verbose, "On errors, print LibTorch's full message and backtrace");
  for (auto* sub : app.get_subcommands({})) sub->fallthrough();  // --verbose may also follow the command name

  std::string help_topic;
  auto* help = app.add_subcommand("help", "Show help for capsnet or one of its commands");
  help->add_option("command", help_topic, "Command to describe, or 'limits' for the range of every numeric flag");

  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const auto* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    if (std::find(names.begin(), names.end(), argv[1]) == names.end()) {
      std::cerr << fmt::format("capsnet: error: unknown command '{}' (commands: {})\n", argv[1],
                               fmt::join(names, ", "));
      return kExitError;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  if (help->parsed()) {
    app.clear();  // help() of a parsed app describes its parsed subcommand, not the tool
    for (const auto& c : commands)
      if (c.app->get_name() == help_topic) {
        std::cout << c.app->help();
        return 0;
      }
    if (help_topic == "limits") {  // the documented range of every numeric flag (docs/reliability.md)
      std::cout << capsnet::apps::cli::numeric_limits_markdown();
      return 0;
    }
    if (!help_topic.empty()) {
      std::cerr << fmt::format("capsnet: error: unknown command '{}'\n", help_topic);
      std::cerr << app.help();
      return kExitError;
    }
    std::cout << app.help();
    return 0;
  }

  try {
    for (const auto& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const capsnet::train::TrainingDiverged& e) {
    // The library names the option field; the command line knows it as a flag.
    std::string msg = e.what();
    if (auto at = msg.find("(lr)"); at != std::string::npos) msg.replace(at, 4, "(--lr)");
    std::cerr << "\ncapsnet: training diverged: " << msg << '\n';
    return kExitDiverged;
  } catch (const c10::Error& e) {
    // LibTorch errors carry a C++ backtrace: one line by default, everything with --verbose.
    std::cerr << "\ncapsnet: error: " << (verbose ? std::string(e.what()) : first_line(e.what_without_backtrace()))
              << '\n';
    return kExitError;
  } catch (const std::bad_alloc&) {
    std::cerr << "\ncapsnet: error: out of memory (try a smaller --batch-size, or fewer --threads / --nproc)\n";
    return kExitError;
  } catch (const std::exception& e) {
    // IdxError, CheckpointError, PngError, invalid options, I/O: one clear line, no stack trace.
    std::cerr << "\ncapsnet: error: " << (verbose ? std::string(e.what()) : first_line(e.what())) << '\n';
    return kExitError;
  }
  return kExitError;
}
