#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "apps/report.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

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
            const auto s = apps::write_report(f->runs, f->out, f->title);
            std::cout << fmt::format("wrote {}: {} training run(s), {} figure(s), {} table(s)\n", f->out,
                                     s.runs_with_metrics, s.figures, s.tables);
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
