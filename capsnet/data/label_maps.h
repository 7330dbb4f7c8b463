#pragma once
// Paired label map -> image data for conditional image synthesis (the CapsPix2pix experiment,
// docs/capspix2pix.md), made from an MNIST-format image set (Fashion-MNIST by default).
//
// Example n: a source image drawn by a hash of (seed, n), bilinearly upscaled 28x28 -> S x S, flipped
// left-right when a hash bit says so. Its label map has three classes per pixel:
//   0 background: ink <= object_threshold
//   2 edge:       object pixel with a background pixel among its 8 neighbours (outside the canvas = background)
//   1 interior:   every other object pixel
// The map fixes the shape and outline; the shading and texture inside (folds, prints, seams) are not
// in it, so a generator must invent them: a small stand-in for the paper's microscopy label maps
// (axons / boutons / background), from which the texture and noise of the image are synthesised.

#include <torch/torch.h>

#include <cstdint>

#include "capsnet/data/mnist.h"

namespace capsnet::data {

/// Label classes of a LabelMaps map.
inline constexpr int64_t kLabelBackground = 0, kLabelInterior = 1, kLabelEdge = 2, kLabelClasses = 3;

struct LabelMapOptions {
  int64_t size = 32;               // S: side of maps and images (>= 8)
  double object_threshold = 0.15;  // ink in [0, 1] above which an upscaled pixel is object
  bool flip = true;                // random left-right flips (a hash bit per example)
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// A batch of consecutive examples.
struct LabelMapBatch {
  torch::Tensor maps;     // [B, 1, S, S] int64 in {0, 1, 2} (background, interior, edge)
  torch::Tensor one_hot;  // [B, 3, S, S] float in {0, 1}: the generator's and discriminator's condition
  torch::Tensor images;   // [B, 1, S, S] float in [-1, 1] (ink 0 -> -1, 1 -> 1): the target
  torch::Tensor labels;   // [B] int64: class of the source image
  torch::Tensor sources;  // [B] int64: index of the source image in the split
};

/// Streamed, seeded generator: example n is a pure function of (seed, n); no state.
class LabelMaps {
 public:
  /// source: images [N, h, w] uint8 (N >= 1), labels [N]. Throws std::invalid_argument on bad shapes/options.
  LabelMaps(ImageSet source, uint64_t seed, LabelMapOptions options = {});

  int64_t size() const { return options_.size; }
  int64_t source_size() const { return source_.size(); }
  const LabelMapOptions& options() const { return options_; }

  /// Examples first_n .. first_n + count - 1 (first_n >= 0, count >= 1).
  LabelMapBatch generate(int64_t first_n, int64_t count) const;

 private:
  ImageSet source_;
  uint64_t seed_;
  LabelMapOptions options_;
};

/// The three-class map of images in [0, 1]. ink: [B, 1, S, S] float -> [B, 1, S, S] int64.
torch::Tensor label_map_of(const torch::Tensor& ink, double object_threshold);

/// [B, 1, S, S] int64 in [0, classes) -> [B, classes, S, S] float one-hot.
torch::Tensor one_hot_maps(const torch::Tensor& maps, int64_t classes = kLabelClasses);

}  // namespace capsnet::data
