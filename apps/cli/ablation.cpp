// capsnet ablation: the paper's routing ablation (Table 1): r in {1, 2, 3, 5} x reconstruction on/off,
// each trained with the same budget and seed, evaluated on the test set; ablation.json + ablation.md.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <memory>

#include "capsnet/train/json_input.h"
#include "capsnet/data/mnist.h"
#include "capsnet/kernels/precision.h"
#include "apps/runtime.h"
#include "capsnet/train/trainer.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace {

namespace fs = std::filesystem;

struct Flags {
  DataFlags data;
  std::string out_dir = "runs/ablation";
  std::vector<int64_t> routing = {1, 2, 3, 5};
  std::string reconstruction = "both";  // on, off, both
  int64_t epochs = 1, steps = 0, batch_size = 100, train_limit = 0, test_limit = 0;
  uint64_t seed = 1;
  bool no_progress = false, fresh = false, overwrite = false;
  int threads = 0;
  std::string precision = "auto";  // --precision: fp32 | bf16 | auto, every sub-run's
  Precision resolved = Precision::kFloat32;  // what it means on this CPU, parsed once before the runs
};

// Paper, Table 1 (MNIST test error %, mean of 3 trials); r = 2 and r = 5 were not reported.
std::string paper_error(int64_t r, bool reconstruction) {
  static const std::map<std::pair<int64_t, bool>, std::string> table = {
      {{1, false}, "0.34"}, {{1, true}, "0.29"}, {{3, false}, "0.35"}, {{3, true}, "0.25"}};
  auto it = table.find({r, reconstruction});
  return it == table.end() ? "–" : it->second;
}

// The precision as resolved on this CPU ("auto" -> bf16 or fp32): what the sub-run computes in.
nlohmann::json run_settings(const Flags& f, int64_t r, bool reconstruction) {
  return {{"routing_iterations", r}, {"reconstruction", reconstruction}, {"epochs", f.epochs},
          {"steps", f.steps},        {"batch_size", f.batch_size},       {"train_limit", f.train_limit},
          {"test_limit", f.test_limit}, {"seed", f.seed},
          {"precision", precision_name(f.resolved)}};
}

// Files that mark a sub-run folder as holding an earlier run (check_run_dir).
const std::vector<std::string> kRunFiles = {"result.json", "settings.json", "checkpoint.pt", "metrics.jsonl"};

// A JSON file's object, or null when it is missing or unreadable.
nlohmann::json read_json_object(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nullptr;
  std::ostringstream text;
  text << in.rdbuf();
  auto j = train::parse_json_or_discarded(text.str());
  return j.is_object() ? j : nlohmann::json();
}

nlohmann::json settings_in(const nlohmann::json& j) {
  auto settings = j.is_object() ? j.value("settings", nlohmann::json()) : nlohmann::json();
  // Sub-runs recorded before --precision existed trained in fp32 (TrainOptions' default then).
  if (settings.is_object() && !settings.contains("precision")) settings["precision"] = "fp32";
  return settings;
}

int run(const Flags& f) {
  std::vector<bool> recon_modes;
  if (f.reconstruction != "off") recon_modes.push_back(true);
  if (f.reconstruction != "on") recon_modes.push_back(false);

  // Plan every sub-run before training any: a finished run with the same settings is reused (so an
  // interrupted ablation continues); the same run unfinished, or asked for again with --fresh, is
  // replaced; an earlier run with other (or unknown) settings is replaced only with --overwrite.
  struct Planned {
    int64_t r;
    bool recon;
    std::string name, dir;
    nlohmann::json settings, reuse;  // reuse: the earlier result, or null to train
  };
  std::vector<Planned> plan;
  for (int64_t r : f.routing)
    for (bool recon : recon_modes) {
      Planned p{r, recon, fmt::format("r{}_{}", r, recon ? "recon" : "norecon"), "", run_settings(f, r, recon), {}};
      p.dir = f.out_dir + "/" + p.name;
      const auto result = read_json_object(p.dir + "/result.json");
      // The settings the folder's run was started with: its result's, else those written at its start.
      auto previous = settings_in(result);
      if (previous.is_null()) previous = settings_in(read_json_object(p.dir + "/settings.json"));
      if (previous == p.settings && !f.fresh && result.contains("test_error") && result["test_error"].is_number()) {
        p.reuse = result;
        if (!p.reuse.contains("precision")) p.reuse["precision"] = p.settings.at("precision");
      }
      if (previous != p.settings) {
        try {
          check_run_dir(p.dir, /*resume_from=*/"", f.overwrite, /*can_resume=*/false, kRunFiles);
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(
              fmt::format("ablation: run {} was trained with other settings ({}): {}", p.name,
                          previous.is_null() ? "not recorded" : train::dump_json(previous), e.what()));
        }
      }
      plan.push_back(std::move(p));
    }

  auto train_set = data::take(data::load_mnist(f.data.resolved(), data::Split::kTrain), f.train_limit);
  auto test_set = data::take(data::load_mnist(f.data.resolved(), data::Split::kTest), f.test_limit);
  fs::create_directories(f.out_dir);

  nlohmann::json results = nlohmann::json::array();
  const size_t total = plan.size();
  size_t index = 0;
  for (const auto& [r, recon, name, dir, settings, reuse] : plan) {
    ++index;
    const std::string result_path = dir + "/result.json";
    if (!reuse.is_null()) {
      std::cerr << fmt::format("ablation: [{}/{}] {}: reusing {} (test error {:.2f}%)\n", index, total, name,
                               result_path, 100 * reuse.at("test_error").get<double>());
      results.push_back(reuse);
      continue;
    }
    fs::remove_all(dir);
    // Written first, so that a later ablation recognises this run even if it is interrupted.
    fs::create_directories(dir);
    write_text_file(dir + "/settings.json", train::dump_json(nlohmann::json{{"settings", settings}}, 2) + "\n");
    std::cerr << fmt::format("ablation: [{}/{}] {}: training\n", index, total, name);
    train::TrainOptions o;
    o.model.routing_iterations = r;
    o.model.reconstruction = recon;
    o.loop.out_dir = dir;
    o.loop.epochs = f.epochs;
    o.loop.max_steps = f.steps;
    o.loop.batch_size = f.batch_size;
    o.loop.seed = f.seed;
    o.loop.checkpoint_every = 0;
    o.loop.progress = !f.no_progress;
    o.loop.precision = f.resolved;
    o.validate();
    std::ostringstream log;
    auto t = train::train(o, train_set, &test_set, log);
    if (!t.test) throw std::runtime_error("ablation: run " + name + " ended without a test evaluation");
    const double images = static_cast<double>(t.steps) * f.batch_size;
    nlohmann::json j = {{"name", name},
                        {"settings", settings},
                        {"routing_iterations", r},
                        {"reconstruction", recon},
                        {"precision", settings.at("precision")},
                        {"steps", t.steps},
                        {"epochs_seen", images / train_set.size()},
                        {"test_accuracy", t.test->accuracy},
                        {"test_error", 1 - t.test->accuracy},
                        {"test_examples", t.test->examples},
                        {"train_seconds", t.seconds},
                        {"train_img_s", t.images_per_second},
                        {"paper_test_error_percent", paper_error(r, recon)}};
    write_text_file(result_path, train::dump_json(j, 2) + "\n");
    std::cerr << fmt::format("ablation: [{}/{}] {}: test error {:.2f}% ({} steps, {:.0f} s)\n", index, total, name,
                             100 * (1 - t.test->accuracy), t.steps, t.seconds);
    results.push_back(j);
  }

  write_text_file(f.out_dir + "/ablation.json", train::dump_json(results, 2) + "\n");
  std::string table = "| routing iterations r | reconstruction | epochs | test error (ours) | test error (paper) |\n"
                      "|---:|:---:|---:|---:|---:|\n";
  for (const auto& j : results) {
    const auto paper = j.at("paper_test_error_percent").get<std::string>();
    table += fmt::format("| {} | {} | {:.2f} | {:.2f}% | {} |\n", j.at("routing_iterations").get<int64_t>(),
                         j.at("reconstruction").get<bool>() ? "yes" : "no", j.at("epochs_seen").get<double>(),
                         100 * j.at("test_error").get<double>(), paper == "–" ? paper : paper + "%");
  }
  write_text_file(f.out_dir + "/ablation.md", table);
  std::cout << table << fmt::format("wrote {0}/ablation.json and {0}/ablation.md\n", f.out_dir);
  return 0;
}

}  // namespace

Subcommand add_ablation(CLI::App& root) {
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand("ablation",
                                  "Routing ablation (paper Table 1): r x reconstruction, same budget and seed each; "
                                  "writes ablation.json and ablation.md");
  add_data_flags(*app, f->data);
  app->add_option("--out", f->out_dir, "Output directory (one sub-directory per run)")->capture_default_str();
  app->add_option("--routing", f->routing, "Routing iterations to compare, comma-separated")
      ->delimiter(',')
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app->add_option("--reconstruction", f->reconstruction, "Decoder + reconstruction loss: on, off or both")
      ->check(CLI::IsMember({"on", "off", "both"}))
      ->capture_default_str();
  app->add_option("--epochs", f->epochs, "Epochs per run")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--steps", f->steps, "Optimizer steps per run (overrides --epochs when > 0)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--batch-size", f->batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--train-limit", f->train_limit, "Only the first N training images (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--test-limit", f->test_limit, "Only the first N test images (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--seed", f->seed, "Seed of every run")->capture_default_str();
  app->add_flag("--fresh", f->fresh, "Retrain runs that already have a result with the same settings");
  add_overwrite_flag(*app, f->overwrite);
  app->add_flag("--no-progress", f->no_progress, "No progress bars");
  add_training_precision_flag(*app, f->precision);
  app->get_option("--precision")
      ->description(
          "Compute precision of every sub-run (as capsnet train: convolutions and decoder; fp32 weights, routing "
          "and losses): fp32, bf16 (AVX512_BF16/AMX CPUs) or auto (bf16 where the CPU has it). Recorded in each "
          "run's settings: a finished run made under another precision is not reused");
  add_threads_flag(*app, f->threads);
  return {app, [f]() {
            f->resolved = precision_from_flag(f->precision);
            if (f->threads > 0) set_threads(f->threads);
            return run(*f);
          }};
}

}  // namespace capsnet::apps::cli
