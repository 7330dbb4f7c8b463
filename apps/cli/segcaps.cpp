// capsnet segcaps: train and evaluate a SegCaps-style capsule segmentation model on cluttered MNIST digits.
#include "apps/experiments/segcaps.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "capsnet/data/mnist.h"
#include "capsnet/data/segmentation.h"
#include "capsnet/train/distributed.h"
#include "capsnet/train/json_input.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"
#include "apps/cli/result_files.h"
#include "apps/cli/loop_flags.h"

namespace capsnet::apps::cli {
namespace {

constexpr const char* kDiceDefinition =
    "per test image: predicted mask P = (capsule length |v| > threshold), target T = main digit ink > "
    "mask_threshold; Dice = 2|P∩T| / (|P| + |T|) (1 when both are empty); reported value = mean over the test images";

/// "auto" or "dataset" -> nullopt, else a number in (0, 1e6]. Throws std::invalid_argument naming the flag.
std::optional<double> parse_pos_weight(const std::string& text) {
  if (text == "auto" || text == "dataset") return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v) || !(v > 0 && v <= 1e6))
    throw std::invalid_argument(fmt::format(
        "--pos-weight must be 'auto', 'dataset' or a number in (0, 1e6] (1 = unweighted), got '{}'", text));
  return v;
}

struct SegCapsFlags : ImageExperimentFlags {
  experiments::SegCapsTrainOptions o;
  data::DigitSegmentationOptions d;
  std::string pos_weight = "auto";  // auto | dataset | a number > 0 (1 = unweighted BCE)
  double recon_weight = 0.131;      // the paper's; 0 = no reconstruction branch
};

// --out, the optimizer, seeds and the test set.
void add_segcaps_training_flags(CLI::App* app, SegCapsFlags* f) {
  add_run_flags(*app, f->o.loop,
                {"Adam steps (each on newly generated images)", "Adam learning rate",
                 "Seed of the model initialisation and the training images"});
  app->add_option("--test-seed", f->test_seed, "Seed of the test images (from the test split)")->capture_default_str();
  app->add_option("--test-size", f->o.test_size, "Generated test images to evaluate")
      ->check(CLI::Range(int64_t{1}, int64_t{1000000}))
      ->capture_default_str();
  app->add_option("--threshold", f->o.threshold, "Predicted mask = capsule length > threshold")
      ->check(CLI::Range(1e-6, 1 - 1e-6))
      ->capture_default_str();
  app->add_option("--val", f->o.validation_size,
                  "Hold out the last N training digits (not trained on); N validation images made from them "
                  "(seed --test-seed + 1) choose the capsule-length threshold, and the test Dice is also reported "
                  "at it (0 = no validation split)")
      ->capture_default_str();
}

// The generated cluttered images.
void add_segcaps_image_flags(CLI::App* app, SegCapsFlags* f) {
  app->add_option("--canvas", f->d.canvas, "Image side (a multiple of 4, >= 28)")
      ->check(CLI::Range(int64_t{28}, int64_t{256}))
      ->capture_default_str();
  app->add_option("--fragments", f->d.fragments, "Clutter fragments of other digits per image")
      ->check(CLI::Range(int64_t{0}, int64_t{64}))
      ->capture_default_str();
  app->add_option("--noise", f->d.noise_std, "Std of the additive Gaussian pixel noise")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
}

// The network and its loss.
void add_segcaps_model_flags(CLI::App* app, SegCapsFlags* f) {
  app->add_option("--routing-iters", f->o.model.routing_iterations, "Routing iterations r in the capsule layers")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app->add_option("--types", f->o.model.types, "Capsule types in the down/up path")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app->add_option("--stem-channels", f->o.model.stem_channels, "Channels of the conv stem (atoms at full resolution)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app->add_option("--pos-weight", f->pos_weight,
                  "Weight of foreground pixels in the BCE: auto = background / foreground pixels of each batch "
                  "(the paper weights by the class ratio); dataset = the same ratio over one pass of training "
                  "images, fixed for the run (the authors' code); or a number in (0, 1e6]; 1 = unweighted")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            try {
              parse_pos_weight(text);
            } catch (const std::invalid_argument& e) {
              return e.what();
            }
            return {};
          },
          "auto|dataset|NUMBER", "POS_WEIGHT"))
      ->capture_default_str();
  app->add_option("--recon-weight", f->recon_weight,
                  "Weight of the masked reconstruction MSE (paper: 0.131); 0 = no reconstruction branch")
      ->capture_default_str();
}

// The time budget, logging, the figure, routing path, checkpoints, precision and the loop's shared flags.
void add_segcaps_run_flags(CLI::App* app, SegCapsFlags* f) {
  app->add_option("--max-minutes", f->max_minutes,
                  "Wall-clock training budget in minutes (0 = none); the model is evaluated where it stopped")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--figure-rows", f->figure_rows, "Test examples in segcaps.png (0 = no figure)")
      ->check(CLI::Range(int64_t{0}, int64_t{100}))
      ->capture_default_str();
  app->add_flag("--composite-routing", f->composite_routing,
                "Route with the composite ATen path instead of the fused operator (same math)");
  add_training_precision_flag(*app, f->precision);
  app->get_option("--precision")
      ->description(
          "Compute precision of the convolutions (stem, every capsule layer's (transposed) convolution, the "
          "decoder's 1x1 convolutions): fp32, bf16 (AVX512_BF16/AMX CPUs; fp32 weights; routing, squash and the "
          "losses stay fp32) or auto (bf16 where the CPU has it)");
  add_loop_flags(*app, f->loop);
}

// The flags into the options, checked before any data is loaded.
void apply_segcaps_flags(SegCapsFlags* f) {
  auto& o = f->o;
  o.loop.precision = precision_from_flag(f->precision);
  o.loop.progress = !f->loop.no_progress;
  o.loop.resume = f->loop.resume;
  o.loop.max_seconds = 60 * f->max_minutes;
  if (f->d.canvas % 4 != 0)
    throw std::invalid_argument(fmt::format("--canvas must be a multiple of 4, got {}", f->d.canvas));
  o.model.image_size = f->d.canvas;
  o.fused_routing = !f->composite_routing;
  const auto pos = parse_pos_weight(f->pos_weight);
  o.model.auto_pos_weight = f->pos_weight == "auto";
  o.model.pos_weight = pos.value_or(1.0);  // "dataset": measured on the training images in run_segcaps
  o.model.recon_weight = f->recon_weight;
  if (o.validation_size == 1)  // each generated image needs clutter from another digit of its set
    throw std::invalid_argument("--val must be 0 or at least 2 (validation images are made of the held-out digits)");
  o.validate();  // before loading the data
  f->d.validate(28);
}

// segcaps.json: the options, data, training figures, the test Dice and the thresholding baseline.
nlohmann::json segcaps_summary(const SegCapsFlags* f, const experiments::SegCapsTrainResult& result,
                               const experiments::ThresholdBaseline& baseline,
                               const std::optional<experiments::ValidatedThreshold>& chosen) {
  const auto& o = f->o;
  const auto& model = result.model;
  nlohmann::json summary = {
      {"task", "segcaps"},
      {"dice_definition", kDiceDefinition},
      {"model", o.model.to_json()},
      {"parameters",
       [&] {
         int64_t n = 0;
         for (const auto& p : model->parameters()) n += p.numel();
         return n;
       }()},
      {"routing", f->composite_routing ? "composite" : "fused"},
      {"precision", precision_name(o.loop.precision)},
      {"pos_weight", f->pos_weight},
      {"recon_weight", o.model.recon_weight},
      {"data",
       {{"dataset", f->data.dataset},
        {"dir", f->data.resolved()},
        {"canvas", f->d.canvas},
        {"fragments", f->d.fragments},
        {"fragment_min", f->d.fragment_min},
        {"fragment_max", f->d.fragment_max},
        {"noise_std", f->d.noise_std},
        {"mask_threshold", f->d.mask_threshold}}},
      {"train_seed", o.loop.seed},
      {"test_seed", f->test_seed},
      {"steps", result.steps},
      {"steps_requested", o.loop.max_steps},
      {"max_minutes", f->max_minutes},
      {"batch_size", o.loop.batch_size},
      {"lr", o.loop.lr},
      {"images_seen", result.steps * o.loop.batch_size},
      {"train_seconds", result.seconds},
      {"train_images_per_second", result.images_per_second},
      {"final_train_loss", result.losses.empty() ? 0.0 : result.losses.back()},
      {"threshold", o.threshold},
      {"test_examples", result.test.examples},
      {"test_dice", result.test.mean_dice},
      {"test_loss", result.test.loss},
      {"baseline",
       {{"method", "predicted mask = input pixel > t; t tuned on training images over 0.05..0.95"},
        {"best_threshold", baseline.best_threshold},
        {"test_dice", baseline.test_dice_at_best},
        {"test_dice_at_0.5", baseline.test_dice_at_half}}},
      {"model_file", train::checkpoint_path(o.loop.out_dir)}};
  if (chosen)
    summary["validation"] = {
        {"rule", "threshold = argmax of the mean validation Dice over 0.05..0.95 (first of equals)"},
        {"held_out_digits", o.validation_size},
        {"seed", f->test_seed + 1},
        {"examples", chosen->val_examples},
        {"thresholds", chosen->thresholds},
        {"dice", chosen->val_dice},
        {"best_threshold", chosen->best_threshold},
        {"val_dice_at_best", chosen->val_dice_at_best},
        {"test_dice_at_best", chosen->test_dice_at_best}};
  return summary;
}

int run_segcaps(const std::shared_ptr<SegCapsFlags>& f, const std::shared_ptr<train::ProcessGroup>& group) {
  const auto t_start = std::chrono::steady_clock::now();
  auto& o = f->o;

  // The validation split: the last --val training digits, never trained on.
  const auto [train_digits, val_digits] =
      data::split_tail(data::load_mnist(f->data.resolved(), data::Split::kTrain), o.validation_size);
  data::DigitSegmentation train_set(train_digits, o.loop.seed, f->d);
  data::DigitSegmentation test_set(data::load_mnist(f->data.resolved(), data::Split::kTest), f->test_seed, f->d);
  if (f->pos_weight == "dataset") {  // one pass: as many generated images as source digits
    o.model.pos_weight = data::foreground_weight(train_set, train_set.source_size());
    std::cout << fmt::format("class weight: background / foreground pixels over {} training images = {:.4f}\n",
                             train_set.source_size(), o.model.pos_weight);
  }

  auto baseline =
      experiments::threshold_baseline(train_set, std::min<int64_t>(1000, o.test_size * 2), test_set, o.test_size);
  std::cout << fmt::format(
                   "thresholding baseline (input > t): test Dice {:.4f} at t = {:.2f} (tuned on training images), "
                   "{:.4f} at t = 0.50\n",
                   baseline.test_dice_at_best, baseline.best_threshold, baseline.test_dice_at_half)
            << std::flush;

  auto result = experiments::train_segcaps(o, train_set, test_set, std::cout, group);
  if (group && group->rank() != 0) return 0;  // rank 0 reports
  auto& model = result.model;
  std::cout << fmt::format("SegCaps test: mean Dice {:.4f} on {} images (loss {:.4f}); threshold baseline {:.4f}\n",
                           result.test.mean_dice, result.test.examples, result.test.loss, baseline.test_dice_at_best);

  std::optional<experiments::ValidatedThreshold> chosen;
  if (o.validation_size > 0) {
    data::DigitSegmentation val_set(val_digits, f->test_seed + 1, f->d);
    chosen = experiments::choose_threshold(model, val_set, o.validation_size, test_set, o.test_size, o.eval_batch_size);
    std::cout << fmt::format(
        "threshold chosen on {} validation images: {:.2f} (validation Dice {:.4f}); test Dice at it {:.4f}\n",
        chosen->val_examples, chosen->best_threshold, chosen->val_dice_at_best, chosen->test_dice_at_best);
  }
  auto summary = segcaps_summary(f.get(), result, baseline, chosen);
  if (f->figure_rows > 0) {
    auto figure = experiments::segcaps_figure(model, test_set, 0, f->figure_rows, o.threshold);
    const std::string png = o.loop.out_dir + "/segcaps.png";
    write_figure(png, figure);
    summary["figure"] = png;
    summary["figure_columns"] = "input | target mask | capsule length |v| | predicted mask (|v| > threshold)";
  }
  write_summary(o.loop.out_dir + "/segcaps.json", summary, t_start);
  return 0;
}

}  // namespace

Subcommand add_segcaps(CLI::App& root) {
  auto f = std::make_shared<SegCapsFlags>();
  auto* app = root.add_subcommand(
      "segcaps",
      "Train and evaluate a SegCaps-style capsule segmentation model on cluttered MNIST digit masks; reports the "
      "mean Dice and the thresholding baseline (writes segcaps.json, segcaps.png, metrics.jsonl, checkpoint.pt in "
      "--out)");
  add_data_flags(*app, f->data);
  add_segcaps_training_flags(app, f.get());
  add_segcaps_image_flags(app, f.get());
  add_segcaps_model_flags(app, f.get());
  add_segcaps_run_flags(app, f.get());
  return {app, [f]() {
            apply_segcaps_flags(f.get());
            return run_training_command(f->loop, f->o.loop.out_dir, f->o.loop.batch_size,
                                        [f](const auto& group) { return run_segcaps(f, group); });
          }};
}

}  // namespace capsnet::apps::cli
