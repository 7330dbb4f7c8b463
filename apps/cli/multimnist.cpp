// capsnet multimnist: train and evaluate a CapsNet on generated MultiMNIST pairs (paper Sec. 6).
#include "capsnet/data/multimnist.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "capsnet/data/mnist.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/distributed.h"
#include "capsnet/train/export.h"
#include "capsnet/train/json_input.h"
#include "apps/experiments/multimnist.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"
#include "apps/cli/result_files.h"
#include "apps/cli/loop_flags.h"

namespace capsnet::apps::cli {
namespace {

constexpr const char* kOverlapDefinition =
    "bounding boxes of the non-zero pixels of each shifted digit; iou = |A∩B|/|A∪B|, "
    "over_smaller = |A∩B|/min(|A|,|B|); mean over the evaluated test pairs";

struct Flags {
  experiments::MultiMnistTrainOptions o;
  std::string precision;  // --precision, parsed into o.loop.precision
  DataFlags data;
  std::string checkpoint;
  uint64_t test_seed = 1001;
  bool eval_only = false;
  std::string model = "capsnet";  // capsnet | cnn (experiments::parse_multimnist_model)
  std::string overlay = "add";  // add | max (data::parse_overlay)
  bool overlay_given = false;   // --overlay on the command line (else --eval-only takes the checkpoint's)
  int64_t figure_correct = 9, figure_wrong = 3, figure_columns = 3;
  LoopFlags loop;
};

// Trains (or with --eval-only loads) the model, evaluates it, and writes the figure and the summary.
int run_multimnist(Flags& flags, std::shared_ptr<train::ProcessGroup> group) {
  const auto t_start = std::chrono::steady_clock::now();
  auto* f = &flags;
  auto& o = f->o;
  data::MultiMnistOptions gen_options;  // the paper's: 28x28 padded to 36x36, shifts up to 4 px
  gen_options.overlay = data::parse_overlay(f->overlay);
  models::CapsNet model{nullptr};  // one of the two is set: the model trained or loaded
  models::BaselineCnn cnn{nullptr};
  std::optional<experiments::MultiMnistTrainResult> trained;
  nlohmann::json summary = {{"task", "multimnist"}, {"test_seed", f->test_seed}};
  std::optional<experiments::MultiMnistEval> eval;
  const int64_t canvas = 28 + 2 * gen_options.pad;
  if (f->eval_only) {
    const std::string path = f->checkpoint.empty() ? train::checkpoint_path(o.loop.out_dir) : f->checkpoint;
    // A training checkpoint, or a weight file (capsnet export; apps/gpu/multimnist.py) whose card holds the
    // checkpoint's training options under "train_options"; read once.
    auto loaded = train::load_any_model(path);
    if (loaded.kind == train::kMatrixCapsNetModel)
      throw std::invalid_argument(fmt::format("{}: holds {}; capsnet multimnist evaluates a CapsNet or the baseline "
                                              "CNN (capsnet eval takes it)",
                                              path, train::describe_model_kind(loaded.kind)));
    nlohmann::json train_options = loaded.train_options.is_null() ? nlohmann::json::object() : loaded.train_options;
    if (!train_options.is_object())
      throw std::invalid_argument(fmt::format("{}: the {} train_options must be an object", path,
                                              loaded.weight_file ? "card's" : "checkpoint's"));
    const int64_t step = loaded.step;
    const int64_t channels = loaded.image_channels(), size = loaded.image_size();
    loaded.set_precision(o.loop.precision);  // as the training run's own evaluations compute (--precision)
    if (loaded.kind == train::kBaselineCnnModel) {
      o.which = experiments::MultiMnistModel::kCnn;
      cnn = std::get<models::BaselineCnn>(loaded.network);
    } else {
      o.which = experiments::MultiMnistModel::kCapsNet;
      model = std::get<models::CapsNet>(loaded.network);
    }
    if (size != canvas || channels != 1)
      throw std::invalid_argument(fmt::format(
          "{}: the model takes {}x{}x{} images, MultiMNIST pairs are 1x{}x{} (train one with capsnet "
          "multimnist)",
          path, channels, size, size, canvas, canvas));
    const int64_t batch = train_options.value("batch_size", int64_t{0});
    summary["mode"] = "eval-only";
    summary["checkpoint"] = path;
    summary["steps"] = step;
    summary["batch_size"] = batch;
    summary["images_seen"] = step * batch;
    summary["train_seed"] = train_options.value("seed", uint64_t{0});
    // Test on pairs made like the training pairs unless --overlay asks for the other overlay. A weight file
    // without the training options (not exported from a MultiMNIST checkpoint) takes --overlay's value; a
    // checkpoint without them predates the option and was trained with max (saved_overlay).
    if (!f->overlay_given && (!loaded.weight_file || train_options.contains("train_generator")))
      gen_options.overlay = experiments::saved_overlay(train_options);
    std::cout << fmt::format("loaded {} (step {}, {} training pairs seen); evaluating in {}\n", path, step,
                             step * batch, precision_name(o.loop.precision));
  }
  const bool is_cnn = o.which == experiments::MultiMnistModel::kCnn;
  // The test pairs through whichever model this run has.
  auto evaluate = [&](const data::MultiMnist& pairs) {
    std::ostream* progress = o.loop.progress ? &std::cerr : nullptr;
    return is_cnn ? experiments::evaluate_multimnist(cnn, pairs, o.test_size, o.eval_batch_size, progress)
                  : experiments::evaluate_multimnist(model, pairs, o.test_size, o.eval_batch_size, progress);
  };

  auto test_set = data::load_mnist(f->data.resolved(), data::Split::kTest);
  data::MultiMnist test_pairs(std::move(test_set), f->test_seed, gen_options);
  if (!f->eval_only) {
    data::MultiMnist train_pairs(data::load_mnist(f->data.resolved(), data::Split::kTrain), o.loop.seed, gen_options);
    trained = experiments::train_multimnist(o, train_pairs, &test_pairs, std::cout, group);
    if (group && group->rank() != 0) return 0;  // rank 0 reports
    if (is_cnn) {
      cnn = models::BaselineCnn(o.cnn);
      train::load_checkpoint(trained->checkpoint, *cnn, nullptr,
                             [&](const nlohmann::json& saved) { return saved == o.cnn.to_json(); });
    } else {
      model = train::load_model(trained->checkpoint);
    }
    eval = trained->test;
    if (!eval) eval = evaluate(test_pairs);  // resumed at the end: nothing trained, nothing evaluated yet
    summary["mode"] = "train";
    summary["checkpoint"] = trained->checkpoint;
    summary["steps"] = trained->steps;
    summary["batch_size"] = o.loop.batch_size;
    summary["images_seen"] = trained->images_seen;
    summary["train_seed"] = o.loop.seed;
    summary["train_seconds"] = trained->seconds;
    summary["train_images_per_second"] = trained->images_per_second;
    if (!trained->losses.empty()) summary["final_train_loss"] = trained->losses.back();
  } else {
    eval = evaluate(test_pairs);
  }
  const auto& r = *eval;
  summary["overlay"] = data::overlay_name(gen_options.overlay);
  summary["model_kind"] = experiments::multimnist_model_name(o.which);
  summary["precision"] = precision_name(o.loop.precision);
  summary["model"] = is_cnn ? cnn->config.to_json() : model->config.to_json();
  summary["parameters"] = is_cnn ? models::count_parameters(*cnn) : models::count_parameters(*model);
  summary["test_examples"] = r.examples;
  summary["accuracy"] = r.accuracy;
  summary["error"] = 1 - r.accuracy;
  summary["digit_accuracy"] = r.digit_accuracy;
  summary["test_loss"] = r.loss;
  summary["eval_seconds"] = r.seconds;
  summary["overlap"] = {{"definition", kOverlapDefinition},
                        {"examples", r.overlap.examples},
                        {"mean_iou", r.overlap.mean_iou()},
                        {"mean_over_smaller", r.overlap.mean_over_smaller()}};
  std::cout << fmt::format(
      "MultiMNIST test: error {:.2f}% (both digits among the two {}: {:.2f}%; single digits "
      "found: {:.2f}%) on {} pairs, loss {:.4f}\n",
      100 * (1 - r.accuracy), is_cnn ? "largest logits" : "longest capsules", 100 * r.accuracy,
      100 * r.digit_accuracy, r.examples, r.loss);
  std::cout << fmt::format(
      "bounding-box overlap of the test pairs: mean IoU {:.1f}%, mean intersection / smaller box {:.1f}% "
      "({} pairs)\n",
      100 * r.overlap.mean_iou(), 100 * r.overlap.mean_over_smaller(), r.overlap.examples);

  std::filesystem::create_directories(o.loop.out_dir);
  if (f->figure_correct + f->figure_wrong > 0) {
    if (is_cnn) {
      std::cerr << "no figure: the CNN has no reconstructions\n";
    } else if (model->config.reconstruction) {
      auto figure = experiments::multimnist_figure(model, test_pairs, f->figure_correct, f->figure_wrong, f->figure_columns);
      const std::string png = o.loop.out_dir + "/multimnist.png";
      write_figure(png, figure);
      summary["figure"] = png;
    } else {
      std::cerr << "no figure: the model has no decoder\n";
    }
  }
  write_summary(o.loop.out_dir + "/multimnist.json", summary, t_start);
  return 0;
}

}  // namespace

Subcommand add_multimnist(CLI::App& root) {
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "multimnist",
      "Train and evaluate a CapsNet (or the baseline CNN) on MultiMNIST: two overlapping digits in 36x36, both "
      "must be found (writes multimnist.json, multimnist.png, metrics.jsonl, checkpoint.pt in --out)");
  add_data_flags(*app, f->data);
  add_run_flags(*app, f->o.loop,
                {"Optimizer steps (each on new generated pairs)", "Adam learning rate",
                 "Seed of the model initialisation and of the training pairs"});
  app->add_option("--lr-decay", f->o.loop.lr_decay, "Learning-rate factor per 60,000 training pairs, in (0, 1]")
      ->check(CLI::Range(1e-9, 1.0))
      ->capture_default_str();
  app->add_option("--test-size", f->o.test_size, "Generated test pairs to evaluate (from the test split)")
      ->check(CLI::Range(int64_t{1}, int64_t{100000000}))
      ->capture_default_str();
  app->add_option("--test-seed", f->test_seed, "Seed of the test pairs (fixed, so runs share one test set)")
      ->capture_default_str();
  app->add_option("--overlay", f->overlay,
                  "Composite of the two digits: add = min(a + b, 1), the authors' generator; max = pixel-wise max "
                  "(--eval-only default: the checkpoint's)")
      ->check(CLI::IsMember({"add", "max"}))
      ->capture_default_str();
  app->add_option("--model", f->model,
                  "capsnet (the paper's, margin loss + reconstructions) or cnn (the baseline CNN of capsnet "
                  "affine, 36x36 input, a sigmoid per class; its two largest logits are its answer)")
      ->check(CLI::IsMember({"capsnet", "cnn"}))
      ->capture_default_str();
  app->add_option("--eval-every", f->o.loop.eval_every,
                  "Also evaluate the --test-size test pairs every N steps: error vs pairs seen (0 = at the end only)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--routing-iters", f->o.model.routing_iterations, "Dynamic routing iterations r")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app->add_option("--conv1-channels", f->o.model.conv1_channels, "Conv1 channels (paper: 256)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app->add_option("--primary-types", f->o.model.primary_types, "PrimaryCaps capsule types (paper: 32)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_flag("--eval-only", f->eval_only, "Evaluate --checkpoint instead of training");
  app->add_option("--checkpoint", f->checkpoint, "Checkpoint, or weight file from capsnet export or apps/gpu/multimnist.py, for --eval-only (default: OUT/checkpoint.pt)");
  app->add_option("--figure-correct", f->figure_correct, "Correctly classified test pairs in the figure")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  app->add_option("--figure-wrong", f->figure_wrong, "Misclassified test pairs in the figure")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  add_training_precision_flag(*app, f->precision);
  add_loop_flags(*app, f->loop);

  return {
      app, [f, app]() {
        auto& o = f->o;
        o.loop.precision = precision_from_flag(f->precision);
        f->overlay_given = app->get_option("--overlay")->count() > 0;
        o.loop.progress = !f->loop.no_progress;
        o.loop.resume = f->loop.resume;
        if (app->get_option("--model")->count() > 0 && f->eval_only)
          throw std::invalid_argument("--model is not read with --eval-only (the checkpoint says which model it is)");
        o.which = experiments::parse_multimnist_model(f->model);
        if (!f->checkpoint.empty() && !f->eval_only)
          throw std::invalid_argument("--checkpoint is only read with --eval-only (training continues with --resume)");
        if (f->eval_only) {
          if (f->loop.threads > 0) set_threads(f->loop.threads);
          return run_multimnist(*f, nullptr);
        }
        o.model.image_size = 28 + 2 * data::MultiMnistOptions{}.pad;
        o.cnn.image_size = o.model.image_size;
        o.validate();  // before loading 50 MB of data
        return run_training_command(f->loop, o.loop.out_dir, o.loop.batch_size,
                                    [f](auto group) { return run_multimnist(*f, group); });
      }};
}

}  // namespace capsnet::apps::cli
