#pragma once
// Training and evaluation of the conditional GANs of models/capspix2pix.h on label map -> image pairs
// (data/label_maps.h), on the one loop (loop.h): each step updates the discriminator, then the
// generator (pix2pix: GAN + lambda L1, Adam with beta1 = 0.5), one Adam holding both parameter groups.
// train::Evaluation on held-out maps: L1, PSNR and SSIM to the true images, and diversity across z.
// Figures: label | generators... | real; variations across z; interpolation between two z vectors.

#include <torch/torch.h>

#include <ostream>
#include <string>
#include <vector>

#include "capsnet/data/label_maps.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/models/capspix2pix.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/train/loop.h"

namespace capsnet::experiments {

struct Pix2pixTrainOptions {
  Pix2pixTrainOptions() {
    loop.out_dir = "runs/capspix2pix";
    loop.epochs = 0;  // a run is measured in steps: loop.max_steps
    loop.max_steps = 2000;
    loop.batch_size = 16;
    loop.lr = 2e-4;     // Adam, both networks (pix2pix)
    loop.lr_decay = 1;  // pix2pix keeps the rate constant (its linear decay starts after 100 epochs)
    loop.checkpoint_every = 0;         // only at the end
    loop.evaluate_each_epoch = false;  // the test maps are evaluated at the end
  }

  models::Pix2pixConfig model;
  /// The loop's options (loop.h). loop.max_steps is the run's length in steps (loop.epochs 0); loop.seed
  /// seeds the initialisation, the training maps and the training noise; loop.max_seconds is a wall-clock
  /// training budget (0 = none); loop.precision is the compute type of both networks' convolutions
  /// (losses fp32).
  train::LoopOptions loop;
  double beta1 = 0.5;   // Adam's beta1 (pix2pix); beta2 = 0.999
  uint64_t eval_seed = 7;  // the noise vectors of the evaluation and the figures
  int64_t test_size = 500;
  int64_t eval_batch_size = 50;
  int64_t diversity_maps = 16;     // test maps whose samples are compared
  int64_t diversity_samples = 8;   // z samples per map
  /// Weight of the mode-seeking term (Mao et al. 2019, MSGAN) in the generator's loss: lambda / (r + 1e-5)
  /// with r = mode_seeking_ratio of two samples per map; 0 = off (pix2pix's loss).
  double mode_seeking = 0;
  bool fused_routing = true;
  /// Maps of the validation set passed to train_pix2pix (0 = none). With it the loop validates (the L1 of
  /// these maps, z fixed by eval_seed) at every loop.eval_every steps and at the end, keeps the lowest as
  /// best.pt, stops early by loop.patience_steps, and the test maps are scored with best.pt.
  int64_t validation_size = 0;

  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// Image-quality scores; images in [0, 1]. a, b: [B, 1, H, W] (H, W >= 11 for SSIM). Returns [B] float64.
torch::Tensor l1_per_image(const torch::Tensor& a, const torch::Tensor& b);
/// 10 log10(1 / MSE) per image (capped at 100 dB for identical images).
torch::Tensor psnr_per_image(const torch::Tensor& a, const torch::Tensor& b);
/// Mean SSIM per image (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, data
/// range 1, over the window positions inside the image).
torch::Tensor ssim_per_image(const torch::Tensor& a, const torch::Tensor& b);
/// Mean L1 over all pairs of samples. samples: [K, 1, H, W] (K >= 2) in [0, 1].
double mean_pairwise_l1(const torch::Tensor& samples);

struct Pix2pixEval {
  int64_t examples = 0;
  double l1 = 0, psnr = 0, ssim = 0;  // means over the test maps, images mapped to [0, 1]
  double diversity = 0;               // mean over diversity_maps of mean_pairwise_l1 of diversity_samples
  double seconds = 0;
};

/// Fixed standard-normal noise vectors: row k of noise(seed, first, count, Z) depends on (seed, first + k) only.
torch::Tensor eval_noise(uint64_t seed, int64_t first, int64_t count, int64_t z_dim);

/// Evaluates maps 0 .. count - 1 of `set` with z = eval_noise(eval_seed, i): no grad.
Pix2pixEval evaluate_pix2pix(models::Pix2pix& model, const data::LabelMaps& set, int64_t count, int64_t batch_size,
                             uint64_t eval_seed, int64_t diversity_maps, int64_t diversity_samples);

/// Label consistency (pix2pix's "FCN score" idea with a classifier): the share of images of test maps
/// 0 .. count - 1 that `classifier`, a CapsNet trained on real source images (e.g. Fashion-MNIST),
/// assigns to the class of the map's source image. Images are mapped to [0, 1] and resized S x S ->
/// the classifier's size (bilinear). `generated` scores generator(map, eval_noise(eval_seed, i));
/// `real` scores the true images of the same maps: the ceiling the generator is held to.
struct LabelConsistency {
  int64_t examples = 0;
  double generated = 0, real = 0;
};
/// std::invalid_argument when the classifier is not a one-channel model or has fewer classes than the labels.
LabelConsistency label_consistency(models::Pix2pix& model, models::CapsNet& classifier, const data::LabelMaps& set,
                                   int64_t count, int64_t batch_size, uint64_t eval_seed);

/// The classifier's predicted classes for images in [0, 1] of any size: [B, 1, H, W] -> [B] int64.
torch::Tensor classify_resized(models::CapsNet& classifier, const torch::Tensor& images01);

/// The run's statistics (losses: the generator loss of every step) and:
struct Pix2pixTrainResult : train::RunStats {
  models::Pix2pix model{nullptr};  // the scored model: best.pt's with a validation set, else the last
  Pix2pixEval test;
  std::string scored_checkpoint;     // best.pt, or the last checkpoint
  int64_t best_validation_step = 0;  // with a validation set: best.pt's step and validation L1
  std::optional<double> best_validation_l1;
};

/// Trains on the one loop (metrics.jsonl, checkpoint.pt, exact resume, NaN guard), evaluates at the end.
/// `validation` (maps 0 .. options.validation_size - 1 are used) is required when validation_size > 0.
Pix2pixTrainResult train_pix2pix(const Pix2pixTrainOptions& options, const data::LabelMaps& train_set,
                                 const data::LabelMaps& test_set, std::ostream& log,
                                 const data::LabelMaps* validation = nullptr);

/// One optimizer for both networks: group 0 = generator, group 1 = discriminator, Adam(lr, (beta1, 0.999)).
std::unique_ptr<torch::optim::Adam> make_pix2pix_optimizer(models::Pix2pix& model, double lr, double beta1);

/// MSGAN's ratio of image to noise distance: mean |a - b| / mean |z_a - z_b|, with a = G(x, z_a) and
/// b = G(x, z_b) [B, 1, S, S], z_a and z_b [B, Z]. Large when different noise gives different images.
torch::Tensor mode_seeking_ratio(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& z_a,
                                 const torch::Tensor& z_b);

/// One training step: discriminator update, then generator update (the same fake batch, D already
/// updated, as pix2pix). labels [B, K, S, S], real [B, 1, S, S] in [-1, 1], z [B, Z].
/// With mode_seeking > 0 the generator's loss gains mode_seeking / (r + 1e-5), r = mode_seeking_ratio of
/// G(x, z) and G(x, z rolled by one row: each map with another example's noise); B >= 2 then, and
/// *ratio (when given) receives r, detached.
/// Returns the losses (detached) computed during the two updates.
models::Pix2pixLosses pix2pix_step(models::Pix2pix& model, torch::optim::Optimizer& optimizer,
                                   const torch::Tensor& labels, const torch::Tensor& real, const torch::Tensor& z,
                                   double mode_seeking = 0, torch::Tensor* ratio = nullptr);

/// Loads a generator+discriminator checkpoint written by train_pix2pix (any config).
models::Pix2pix load_pix2pix(const std::string& checkpoint);

/// Maps {0, 1, 2} to grey levels 0, 0.5, 1 for figures. maps: [B, 1, S, S] int64 -> float [B, 1, S, S].
torch::Tensor label_map_image(const torch::Tensor& maps);

/// Figure: one row per test map i in [first, first + rows): label | each model's image | real, zoomed by
/// `zoom`; z = eval_noise(eval_seed, i). Returns float [rows (S z + 2) + 2, (models + 2) (S z + 2) + 2] in [0, 1].
torch::Tensor pix2pix_comparison_figure(std::vector<models::Pix2pix> models, const data::LabelMaps& set, int64_t first,
                                        int64_t rows, uint64_t eval_seed, int64_t zoom = 2);

/// Figure: one row per model: label of map `index` | `samples` images for different z. float in [0, 1].
torch::Tensor pix2pix_variations_figure(std::vector<models::Pix2pix> models, const data::LabelMaps& set,
                                        int64_t index, int64_t samples, uint64_t eval_seed, int64_t zoom = 2);

/// Figure: one row per model: label of map `index` | images for z = (1 - t) z1 + t z2, t = 0 .. 1 in
/// `steps` steps (z1, z2 from eval_noise). float in [0, 1].
torch::Tensor pix2pix_interpolation_figure(std::vector<models::Pix2pix> models, const data::LabelMaps& set,
                                           int64_t index, int64_t steps, uint64_t eval_seed, int64_t zoom = 2);

}  // namespace capsnet::experiments
