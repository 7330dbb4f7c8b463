// capsnet em: train and evaluate matrix capsules with EM routing (Hinton, Sabour & Frosst 2018).
#include "apps/experiments/em.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "capsnet/data/mnist.h"
#include "capsnet/train/distributed.h"
#include "capsnet/train/json_input.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"
#include "apps/cli/result_files.h"
#include "apps/cli/loop_flags.h"

namespace capsnet::apps::cli {

namespace {

struct EmFlags {
  experiments::EmTrainOptions o;
  std::string precision;  // --precision, parsed into o.loop.precision
  DataFlags data;
  LoopFlags loop;
  double max_minutes = 0;
};

// The run's flags (add_run_flags), the optimizer's, the spread-loss margins, the data's size and augmentation.
void add_em_training_flags(CLI::App* app, EmFlags& f) {
  auto& o = f.o;
  add_run_flags(*app, o.loop, {});
  app->add_option("--weight-decay", o.loop.weight_decay, "Adam weight decay (L2)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--lr-decay", o.loop.lr_decay, "Learning rate multiplied by this per epoch, smoothly per step (1 = constant)")
      ->capture_default_str();
  app->add_option("--margin-start", o.margin_start, "Spread-loss margin at the first step (paper: 0.2)")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();
  app->add_option("--margin-end", o.margin_end, "Spread-loss margin at the last step (paper: 0.9)")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();
  app->add_option("--max-shift", o.max_shift,
                  "Random translation of each training image by up to this many pixels in each direction, zero "
                  "padded (0 = none, the paper; 2 = CapsNet's MNIST augmentation)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--train-size", o.train_size, "First training examples used (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--test-size", o.test_size, "First test examples evaluated (0 = none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

// EM routing and the network's widths (paper: A = 64, B = C = D = 32).
void add_em_model_flags(CLI::App* app, const std::shared_ptr<EmFlags>& f) {
  auto& m = f->o.model;
  app->add_option("--routing-iters", m.routing_iterations, "EM routing iterations (paper: 3)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app->add_option("--lambda-schedule", m.lambda_schedule,
                  "Inverse temperature per routing iteration t: paper = --lambda-base (1 - 0.95^(t+1)) (the authors' "
                  "schedule), linear = --lambda-first .. --lambda-last (the earlier default)")
      ->check(CLI::IsMember({"paper", "linear"}))
      ->capture_default_str();
  app->add_option("--lambda-base", m.lambda_base,
                  "lambda_0 of --lambda-schedule paper: lambda_t = base (1 - 0.95^(t+1)); the authors' 0.01 goes with "
                  "their cost (--paper-cost), 1 with the cost scaled by J/I (the default; see docs/em.md)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--lambda-first", m.lambda_first,
                  "Inverse temperature of the first routing iteration (--lambda-schedule linear)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--lambda-last", m.lambda_last,
                  "Inverse temperature of the last routing iteration (--lambda-schedule linear)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto* logit_offset = app->add_option_function<std::string>(
                              "--logit-offset",
                              [f](const std::string& v) { f->o.model.logit_offset_outside_lambda = v == "outside"; },
                              "outside: a = logistic(beta_a - lambda cost), beta_a learns at its own scale; inside: "
                              "logistic(lambda (beta_a - cost)) (the earlier default)")
                           ->check(CLI::IsMember({"outside", "inside"}));
  logit_offset->default_str("outside");
  auto* window_routing = app->add_option_function<std::string>(
                                "--window-routing",
                                [f](const std::string& v) { f->o.model.cross_window_routing = v == "cross"; },
                                "cross: a child's R sums to 1 over every parent of every window containing it (the "
                                "paper); per-window: over the parents of each window (the earlier default)")
                             ->check(CLI::IsMember({"cross", "per-window"}));
  window_routing->default_str("cross");
  app->add_option("--conv1-channels", m.conv1_channels, "A: ReLU Conv1 channels (paper: 64)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app->add_option("--primary-types", m.primary_types, "B: primary capsule types (paper: 32)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_option("--caps1-types", m.conv1_caps_types, "C: ConvCaps1 types (paper: 32)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_option("--caps2-types", m.conv2_caps_types, "D: ConvCaps2 types (paper: 32)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_flag("!--paper-cost", m.normalize_cost,
                "Use the paper's cost (beta_u + log sigma) * sum_i R_ij; by default sum_i R_ij is scaled by J/I");
  app->add_flag("!--no-coordinate-addition", m.coordinate_addition, "No coordinate addition in the class capsules");
  app->add_option("--variance-eps", m.variance_eps,
                  "Added to every sigma^2 of EM routing (its log and the E-step's 1/sigma^2): a floor on how peaked a "
                  "parent's Gaussian can get")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_flag("--standardize-cost", m.standardize_cost,
                "Standardise the costs over the parents of each routing problem before the logistic (not in the "
                "paper; use with a lambda of order 1, e.g. --lambda-schedule linear --lambda-first 1 --lambda-last 1)");
}

// Evaluation, checkpoints, the time budget, precision and the loop's shared flags.
void add_em_run_flags(CLI::App* app, EmFlags& f) {
  auto& o = f.o;
  app->add_option("--eval-every", o.loop.eval_every,
                  "Also evaluate the first --test-size test images every N steps (0 = only at the end)")
      ->capture_default_str();
  app->add_option("--max-minutes", f.max_minutes,
                  "Wall-clock training budget in minutes (0 = none); evaluated where it stopped (the margin "
                  "schedule still spans --steps)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  add_training_precision_flag(*app, f.precision);
  app->get_option("--precision")
      ->description(
          "Compute precision of the convolutions (Conv1, PrimaryCaps): fp32, bf16 (AVX512_BF16/AMX CPUs; fp32 "
          "weights; the 4x4 votes, EM routing and the spread loss stay fp32) or auto (bf16 where the CPU has it)");
  add_loop_flags(*app, f.loop);
}

// em.json: the options, the training figures and the test result when there is one.
nlohmann::json em_summary(const EmFlags& f, const std::string& dir, const experiments::EmTrainResult& r) {
  const auto& o = f.o;
  nlohmann::json summary = {{"task", "em"},
                            {"dataset", f.data.dataset},
                            {"data_dir", dir},
                            {"model", o.model.to_json()},
                            {"train", o.to_json()},
                            {"steps", r.steps},
                            {"images_seen", r.images_seen},
                            {"train_seconds", r.seconds},
                            {"train_images_per_second", r.images_per_second},
                            {"final_train_loss", r.losses.empty() ? 0.0 : r.losses.back()},
                            {"final_train_accuracy", r.final_train_accuracy},
                            {"model_path", r.checkpoint},
                            {"threads", at::get_num_threads()}};
  if (r.test.examples > 0) {
    summary["test_examples"] = r.test.examples;
    summary["test_accuracy"] = r.test.accuracy;
    summary["test_error"] = 1 - r.test.accuracy;
    summary["test_spread_loss"] = r.test.loss;
    summary["eval_seconds"] = r.test.seconds;
  }
  return summary;
}

int run_em(const std::shared_ptr<EmFlags>& f, const std::shared_ptr<train::ProcessGroup>& group) {
  const auto t_start = std::chrono::steady_clock::now();
  auto& o = f->o;
  const std::string dir = f->data.resolved();
  auto train_set = data::load_mnist(dir, data::Split::kTrain);
  auto test_set = data::load_mnist(dir, data::Split::kTest);
  std::cout << fmt::format("{}: {} training, {} test images from {}\n", f->data.dataset, train_set.size(),
                           test_set.size(), dir);
  auto r = experiments::train_em(o, train_set, &test_set, std::cout, group);
  if (group && group->rank() != 0) return 0;  // rank 0 reports
  auto summary = em_summary(*f, dir, r);
  if (r.test.examples > 0)
    std::cout << fmt::format("{} test: accuracy {:.2f}% (error {:.2f}%) on {} images, spread loss {:.4f}\n",
                             f->data.dataset, 100 * r.test.accuracy, 100 * (1 - r.test.accuracy), r.test.examples,
                             r.test.loss);
  write_summary(o.loop.out_dir + "/em.json", summary, t_start);
  return 0;
}

}  // namespace

Subcommand add_em(CLI::App& root) {
  auto f = std::make_shared<EmFlags>();
  auto* app = root.add_subcommand(
      "em",
      "Matrix capsules with EM routing (4x4 poses, spread loss): train and evaluate on MNIST or Fashion-MNIST "
      "(writes em.json, metrics.jsonl, checkpoint.pt in --out)");
  add_data_flags(*app, f->data);
  add_em_training_flags(app, *f);
  add_em_model_flags(app, f);
  add_em_run_flags(app, *f);
  return {app, [f]() {
            auto& o = f->o;
            o.loop.precision = precision_from_flag(f->precision);
            o.loop.progress = !f->loop.no_progress;
            o.loop.resume = f->loop.resume;
            o.loop.max_seconds = 60 * f->max_minutes;
            o.validate();  // before loading the data
            return run_training_command(f->loop, o.loop.out_dir, o.loop.batch_size,
                                        [f](const auto& group) { return run_em(f, group); });
          }};
}

}  // namespace capsnet::apps::cli
