#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "apps/report.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace {

namespace fs = std::filesystem;

// The report reads the whole --runs folder: its page may replace an earlier page (.html) there, never
// a checkpoint, metrics, figure or result beside it.
std::vector<std::string> report_inputs(const std::string& runs) {
  std::vector<std::string> inputs;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(runs, fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end; it.increment(ec))
    if (it->is_regular_file(ec) && it->path().extension() != ".html") inputs.push_back(it->path().string());
  return inputs;
}

}  // namespace

Subcommand add_report(CLI::App& root) {
  struct Flags {
    std::string runs = "runs", out = "runs/report.html", title = "capsnet report";
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "report", "One self-contained HTML page of the training curves, figures and result tables under --runs");
  app->add_option("--runs", f->runs, "Directory to scan (metrics.jsonl, *.png, *.json, bench *.jsonl)")
      ->capture_default_str();
  app->add_option("--out", f->out, "HTML file to write")->capture_default_str();
  app->add_option("--title", f->title, "Page title")->capture_default_str();
  return {app, [f]() {
            check_not_an_input(f->out, report_inputs(f->runs));
            const auto s = apps::write_report(f->runs, f->out, f->title);
            std::cout << fmt::format("wrote {}: {} training run(s), {} figure(s), {} table(s)\n", f->out,
                                     s.runs_with_metrics, s.figures, s.tables);
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
