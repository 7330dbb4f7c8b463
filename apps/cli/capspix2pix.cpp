// capsnet capspix2pix: conditional image synthesis (label map -> image) with a capsule generator
// (CapsPix2pix, Bass et al. 2019) or the pix2pix CNN U-net, one PatchGAN discriminator (docs/capspix2pix.md).
#include "apps/experiments/capspix2pix.h"

#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "capsnet/data/label_maps.h"
#include "capsnet/data/mnist.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/json_input.h"
#include "apps/cli/commands.h"
#include "apps/cli/result_files.h"
#include "apps/cli/loop_flags.h"

namespace capsnet::apps::cli {
namespace {

int64_t count(const std::vector<torch::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

struct Pix2pixFlags : ImageExperimentFlags {
  experiments::Pix2pixTrainOptions o;
  data::LabelMapOptions maps;
  std::string compare_with;  // another run's checkpoint.pt, drawn beside this one in the figures
  std::string classifier;    // a CapsNet checkpoint for the label-consistency score
};

// --out, the optimizer, seeds and the held-out maps.
void add_capspix2pix_training_flags(CLI::App* app, Pix2pixFlags* f) {
  add_run_flags(*app, f->o.loop,
                {"Training steps (each: one D and one G update on newly generated maps)",
                 "Adam learning rate of both networks (beta1 = 0.5)",
                 "Seed of the initialisation, the training maps and the training noise"});
  app->add_option("--test-seed", f->test_seed, "Seed of the held-out maps (from the test split)")
      ->capture_default_str();
  app->add_option("--test-size", f->o.test_size, "Held-out maps to score")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--val", f->o.validation_size,
                  "Hold out the last N training images (not trained on): their maps (seed --test-seed + 1) are "
                  "scored by L1 at every --eval-every steps and at the end, the lowest is kept as best.pt and the "
                  "test maps are scored with it (0 = no validation: the last model is scored)")
      ->capture_default_str();
  app->add_option("--eval-every", f->o.loop.eval_every,
                  "Steps between evaluations (validation and test, each an \"eval\" record; 0 = at the end only)")
      ->capture_default_str();
  app->add_option("--patience", f->o.loop.patience_steps,
                  "Stop when the best validation L1 is this many steps old (needs --val and --eval-every; 0 = "
                  "train all --steps)")
      ->capture_default_str();
}

// The capsule layers and the loss.
void add_capspix2pix_model_flags(CLI::App* app, Pix2pixFlags* f) {
  app->add_option("--routing-iters", f->o.model.routing_iterations, "Routing iterations r in the capsule layers")
      ->capture_default_str();
  app->add_option("--recon-weight", f->o.model.l1_weight, "Weight lambda of the L1 term (pix2pix: 100)")
      ->capture_default_str();
  app->add_option("--cnn-channels", f->o.model.cnn_channels,
                  "Channels F of the pix2pix U-net generator's first level (levels F, 2F, 4F, 4F; --generator cnn): "
                  "32 = 1,023,873 parameters; 9 = 82,621, the nearest to the capsule generator's 74,977")
      ->capture_default_str();
  app->add_option("--mode-seeking", f->o.mode_seeking,
                  "Weight of MSGAN's mode-seeking term in the generator's loss (Mao et al. 2019; they use 1): rewards "
                  "different images for different z on the same map (0 = off, pix2pix's loss)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

// The time budget, logging, checkpoints, figures and scores, routing path, precision and the loop's flags.
void add_capspix2pix_run_flags(CLI::App* app, Pix2pixFlags* f) {
  app->add_option("--max-minutes", f->max_minutes,
                  "Wall-clock training budget in minutes (0 = none); the model is evaluated where it stopped")
      ->capture_default_str();
  app->add_option("--figure-rows", f->figure_rows, "Held-out maps in capspix2pix_compare.png (0 = no figures)")
      ->capture_default_str();
  app->add_option("--compare-with", f->compare_with,
                  "Checkpoint of another capspix2pix run, drawn beside this one in the figures "
                  "(label | pix2pix | CapsPix2pix | real)");
  app->add_option("--classifier", f->classifier,
                  "CapsNet checkpoint trained on the real images (e.g. capsnet train --dataset fashion-mnist): scores "
                  "label consistency, the share of generated test images it assigns to the source image's class "
                  "(and the same for the real images, the ceiling)");
  app->add_flag("--composite-routing", f->composite_routing,
                "Route with the composite ATen path instead of the fused operator (same math)");
  add_training_precision_flag(*app, f->precision);
  app->get_option("--precision")
      ->description(
          "Compute precision of the generator's and the discriminator's convolutions (plain, transposed, capsule "
          "layers'): fp32, bf16 (AVX512_BF16/AMX CPUs; fp32 weights; routing, BatchNorm and the losses stay fp32) "
          "or auto (bf16 where the CPU has it). --compare-with and --classifier models run in fp32");
  add_loop_flags(*app, f->loop);
}

// The flags into the options, checked before any data is loaded.
void apply_capspix2pix_flags(Pix2pixFlags* f) {
  auto& o = f->o;
  o.loop.precision = precision_from_flag(f->precision);
  o.loop.progress = !f->loop.no_progress;
  o.loop.resume = f->loop.resume;
  o.loop.max_seconds = 60 * f->max_minutes;
  o.fused_routing = !f->composite_routing;
  o.model.image_size = f->maps.size;
  if (o.loop.patience_steps > 0 && (o.validation_size == 0 || o.loop.eval_every == 0))
    throw std::invalid_argument("--patience needs --val N (the maps it watches) and --eval-every S (how often)");
  o.validate();  // before loading the data
}

// capspix2pix.json: the options, data, training figures and the held-out scores.
nlohmann::json capspix2pix_summary(const Pix2pixFlags* f, const experiments::Pix2pixTrainResult& result,
                                   const std::optional<experiments::LabelConsistency>& consistency) {
  const auto& o = f->o;
  const auto& model = result.model;
  const auto& t = result.test;
  nlohmann::json summary = {
      {"task", "capspix2pix"},
      {"generator", o.model.generator},
      {"model", o.model.to_json()},
      {"generator_parameters", count(model->generator_parameters())},
      {"discriminator_parameters", count(model->discriminator_parameters())},
      {"routing", f->composite_routing ? "composite" : "fused"},
      {"precision", precision_name(o.loop.precision)},
      {"data",
       {{"dataset", f->data.dataset},
        {"dir", f->data.resolved()},
        {"size", f->maps.size},
        {"object_threshold", f->maps.object_threshold},
        {"flip", f->maps.flip},
        {"classes", "0 background, 1 interior, 2 edge"}}},
      {"train_seed", o.loop.seed},
      {"test_seed", f->test_seed},
      {"eval_seed", o.eval_seed},
      {"steps", result.steps},
      {"steps_requested", o.loop.max_steps},
      {"max_minutes", f->max_minutes},
      {"batch_size", o.loop.batch_size},
      {"lr", o.loop.lr},
      {"beta1", o.beta1},
      {"l1_weight", o.model.l1_weight},
      {"mode_seeking", o.mode_seeking},
      {"images_seen", result.steps * o.loop.batch_size},
      {"train_seconds", result.seconds},
      {"train_images_per_second", result.images_per_second},
      {"threads", at::get_num_threads()},
      {"test",
       {{"maps", t.examples},
        {"l1", t.l1},
        {"psnr_db", t.psnr},
        {"ssim", t.ssim},
        {"diversity", t.diversity},
        {"diversity_maps", o.diversity_maps},
        {"diversity_samples", o.diversity_samples},
        {"definitions",
         "images mapped to [0, 1]; L1 = mean |G(x, z) - y|; PSNR = 10 log10(1 / MSE) per image; SSIM: "
         "11x11 Gaussian window (sigma 1.5), mean over the map; all averaged over the test maps, z fixed "
         "by eval_seed; diversity = mean pairwise L1 of diversity_samples images of one map (different "
         "z), averaged over diversity_maps maps"}}},
      {"model_file", train::checkpoint_path(o.loop.out_dir)},
      {"scored_checkpoint", result.scored_checkpoint}};
  if (result.best_validation_l1)
    summary["validation"] = {{"maps", o.validation_size},
                             {"seed", f->test_seed + 1},
                             {"rule", "the lowest validation L1 (z fixed by eval_seed) over the evaluations"},
                             {"eval_every", o.loop.eval_every},
                             {"patience_steps", o.loop.patience_steps},
                             {"best_step", result.best_validation_step},
                             {"best_l1", *result.best_validation_l1}};

  if (consistency)
    summary["test"]["label_consistency"] = {
        {"classifier", f->classifier},
        {"generated", consistency->generated},
        {"real", consistency->real},
        {"definition",
         "share of the test maps' images (z fixed by eval_seed) that the classifier assigns to the source "
         "image's class; images in [0, 1], resized bilinearly to the classifier's size; real = the true "
         "images of the same maps"}};
  return summary;
}

// The comparison, variation and interpolation figures of `model` (and `other`, when given), listed in summary.
void write_capspix2pix_figures(const Pix2pixFlags* f, const models::Pix2pix& model,
                               const std::optional<models::Pix2pix>& other, const data::LabelMaps& test_set,
                               nlohmann::json& summary) {
  const auto& o = f->o;
  // Column order as in the seed deck: pix2pix before CapsPix2pix.
  std::vector<models::Pix2pix> models{model};
  if (other) {
    if ((*other)->config.image_size != o.model.image_size)
      throw std::invalid_argument("--compare-with: that model has another image size");
    if ((*other)->config.generator == "cnn")
      models.insert(models.begin(), *other);
    else
      models.push_back(*other);
    summary["compared_with"] = f->compare_with;
  }
  std::string names;  // "CapsPix2pix" or "CapsPix2pix | pix2pix": the figures' rows, in order
  for (const auto& m : models)
    names += (names.empty() ? "" : " | ") + std::string(m->config.generator == "caps" ? "CapsPix2pix" : "pix2pix");
  auto write = [&](const std::string& name, const torch::Tensor& figure, const std::string& what) {
    const std::string png = o.loop.out_dir + "/" + name;
    write_figure(png, figure);
    summary["figures"][name] = what;
  };
  write("capspix2pix_compare.png",
        experiments::pix2pix_comparison_figure(models, test_set, 0, f->figure_rows, o.eval_seed),
        "one row per held-out map: label | " + names + " | real");
  write("capspix2pix_variations.png", experiments::pix2pix_variations_figure(models, test_set, 0, 8, o.eval_seed),
        "one row per model (" + names + "): label of held-out map 0 | 8 samples, different z");
  write("capspix2pix_interpolation.png",
        experiments::pix2pix_interpolation_figure(models, test_set, 0, 8, o.eval_seed),
        "one row per model (" + names + "): label of held-out map 0 | z = (1 - t) z1 + t z2, t = 0..1");
}

int run_capspix2pix(const std::shared_ptr<Pix2pixFlags>& f, const std::shared_ptr<train::ProcessGroup>& group) {
  if (group) throw std::invalid_argument("capspix2pix runs in one process only (--nproc 1)");
  const auto t_start = std::chrono::steady_clock::now();
  auto& o = f->o;
  std::optional<models::Pix2pix> other;
  if (!f->compare_with.empty()) other = experiments::load_pix2pix(f->compare_with);  // fail before training
  std::optional<models::CapsNet> classifier;
  if (!f->classifier.empty()) classifier = train::load_model(f->classifier);
  // The validation split: the last --val training images, never trained on.
  const auto [train_images, val_images] =
      data::split_tail(data::load_mnist(f->data.resolved(), data::Split::kTrain), o.validation_size);
  data::LabelMaps train_set(train_images, o.loop.seed, f->maps);
  data::LabelMaps test_set(data::load_mnist(f->data.resolved(), data::Split::kTest), f->test_seed, f->maps);
  std::optional<data::LabelMaps> val_set;
  if (o.validation_size > 0) val_set.emplace(val_images, f->test_seed + 1, f->maps);

  auto result = experiments::train_pix2pix(o, train_set, test_set, std::cout, val_set ? &*val_set : nullptr);
  if (result.best_validation_l1)
    std::cout << fmt::format("scored with the best-validation checkpoint {} (step {}, validation L1 {:.4f})\n",
                             result.scored_checkpoint, result.best_validation_step, *result.best_validation_l1);
  auto& model = result.model;
  const auto& t = result.test;
  std::cout << fmt::format(
      "{} generator, test ({} maps): L1 {:.4f} PSNR {:.2f} dB SSIM {:.4f}; diversity across z {:.4f}\n",
      o.model.generator, t.examples, t.l1, t.psnr, t.ssim, t.diversity);

  std::optional<experiments::LabelConsistency> consistency;
  if (classifier) {
    consistency =
        experiments::label_consistency(model, *classifier, test_set, o.test_size, o.eval_batch_size, o.eval_seed);
    std::cout << fmt::format("label consistency ({} maps, classifier {}): generated {:.2f}%, real images {:.2f}%\n",
                             consistency->examples, f->classifier, 100 * consistency->generated,
                             100 * consistency->real);
  }

  auto summary = capspix2pix_summary(f.get(), result, consistency);
  if (f->figure_rows > 0) write_capspix2pix_figures(f.get(), model, other, test_set, summary);
  write_summary(o.loop.out_dir + "/capspix2pix.json", summary, t_start);
  return 0;
}

}  // namespace

Subcommand add_capspix2pix(CLI::App& root) {
  auto f = std::make_shared<Pix2pixFlags>();
  f->data.dataset = "fashion-mnist";
  auto* app = root.add_subcommand(
      "capspix2pix",
      "Train a conditional GAN (label map -> image) with a capsule U-net generator (CapsPix2pix) or the pix2pix "
      "CNN U-net, PatchGAN discriminator, GAN + lambda L1; reports L1, PSNR, SSIM and diversity on held-out maps "
      "(writes capspix2pix.json, capspix2pix_*.png, metrics.jsonl, checkpoint.pt in --out)");
  app->add_option("--generator", f->o.model.generator, "Generator: caps (CapsPix2pix) or cnn (pix2pix U-net)")
      ->check(CLI::IsMember({"caps", "cnn"}))
      ->capture_default_str();
  add_data_flags(*app, f->data);
  add_capspix2pix_training_flags(app, f.get());
  add_capspix2pix_model_flags(app, f.get());
  add_capspix2pix_run_flags(app, f.get());
  return {app, [f]() {
            apply_capspix2pix_flags(f.get());
            return run_training_command(f->loop, f->o.loop.out_dir, f->o.loop.batch_size,
                                        [f](const auto& group) { return run_capspix2pix(f, group); });
          }};
}

}  // namespace capsnet::apps::cli
