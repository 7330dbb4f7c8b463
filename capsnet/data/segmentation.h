#pragma once
// Cluttered-digit segmentation from MNIST (for the SegCaps experiment): one whole digit on a noisy
// canvas among fragments cut from other digits; the target is the per-pixel mask of the whole digit.
// Fragments are strokes of the same brightness as the digit, so thresholding the input cannot
// separate them: the model has to recognise which strokes form the digit.

#include <torch/torch.h>

#include <cstdint>

#include "capsnet/data/mnist.h"

namespace capsnet::data {

struct DigitSegmentationOptions {
  /// Side S of the square canvas; the source digit (28x28 for MNIST) is placed whole inside it.
  int64_t canvas = 32;
  /// Number of clutter fragments per image.
  int64_t fragments = 3;
  /// Fragment side, uniform in [fragment_min, fragment_max] (square crops of other digits).
  int64_t fragment_min = 8;
  int64_t fragment_max = 12;
  /// Std of the additive Gaussian pixel noise (the image is clamped to [0, 1] afterwards).
  double noise_std = 0.1;
  /// A pixel belongs to the target when the main digit's ink (in [0, 1]) is above this.
  double mask_threshold = 0.5;
  /// Throws std::invalid_argument naming the bad field (source_side: side of the source digits).
  void validate(int64_t source_side) const;
};

/// A batch of consecutive examples.
struct SegmentationBatch {
  torch::Tensor images;  // [B, 1, S, S] float in [0, 1]: digit, fragments (pixel-wise max), noise
  torch::Tensor masks;   // [B, 1, S, S] float in {0, 1}: main digit ink > mask_threshold
  torch::Tensor labels;  // [B] int64: class of the main digit
};

/// Streamed, seeded generator: example n is a pure function of (seed, n) (splitmix64 hashes, no state).
/// Example n: main digit = a uniformly drawn source digit, placed at a uniform offset in [0, S - side]^2; then `fragments` crops of other random source
/// digits (side uniform in [fragment_min, fragment_max], centred near an ink pixel so they carry strokes)
/// at uniform positions, combined by pixel-wise max; then N(0, noise_std^2) noise, clamp to [0, 1].
class DigitSegmentation {
 public:
  /// source: images [N, h, h] uint8 (N >= 2), labels [N]. Throws std::invalid_argument on bad shapes/options.
  DigitSegmentation(ImageSet source, uint64_t seed, DigitSegmentationOptions options = {});

  int64_t canvas_size() const { return options_.canvas; }
  int64_t source_size() const { return source_.size(); }
  const DigitSegmentationOptions& options() const { return options_; }

  /// Examples first_n .. first_n + count - 1 (first_n >= 0, count >= 1).
  SegmentationBatch generate(int64_t first_n, int64_t count) const;

 private:
  void render(int64_t n, float* image, float* mask, int64_t* label) const;

  ImageSet source_;
  uint64_t seed_;
  DigitSegmentationOptions options_;
  int64_t side_ = 0;
};

/// The SegCaps authors' class weight: background / foreground mask pixels summed over the examples
/// 0 .. count - 1 of `set` that have any foreground (their code weighs the positive class of the whole
/// training set by this ratio). count >= 1; 1 when no example has foreground.
double foreground_weight(const DigitSegmentation& set, int64_t count);

/// Dice coefficient per image, 2 |P ∩ T| / (|P| + |T|), of binary masks (value > 0.5 counts as set);
/// 1 when both are empty. predicted, target: [B, ...] (same shape). Returns [B] float64.
torch::Tensor dice_per_image(const torch::Tensor& predicted, const torch::Tensor& target);

}  // namespace capsnet::data
