#pragma once
// Distorted MNIST for the spatial-transformer experiment (Jaderberg et al. 2015, Sec. 4.1, "RTS":
// rotation, scale and translation): each digit is rotated by an angle uniform in [-45, 45] degrees,
// scaled by one factor uniform in [0.7, 1.2] (the same on both axes), and placed at a position uniform
// over those that keep the whole warped digit inside a 42x42 black canvas. Bilinear warp by inverse
// mapping (data::warp_affine), so this is our own generator in the spirit of the paper's, not its data.
//
// Determinism: example n is a pure function of (seed, n) (and the source images): its parameters come
// from our own counter-based splitmix64 stream, identical on every platform and LibTorch version.

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "capsnet/data/affine.h"
#include "capsnet/data/mnist.h"

namespace capsnet::data {

/// Side of the distorted-MNIST canvas (the paper's RTS set is 42x42).
constexpr int64_t kDistortedCanvas = 42;

/// Sampling ranges: rotation uniform in [-max_rotation_deg, max_rotation_deg], one isotropic scale
/// uniform in [min_scale, max_scale]; the translation is always "anywhere inside the canvas".
struct DistortionRanges {
  double max_rotation_deg = 45;
  double min_scale = 0.7, max_scale = 1.2;
  /// Throws std::invalid_argument naming the bad range.
  void validate() const;
};

/// The distortion of example n under `seed` for a digit with bounding box `box` in a src_h x src_w
/// image: rotation and scale from `ranges` (scale_x == scale_y, no shear), then a translation uniform
/// over the positions that keep the warped box (grown by the 1 px bilinear footprint) inside the
/// canvas; a digit too large to fit is centred (and cropped). An empty box counts as the whole image.
AffineParams draw_distortion(uint64_t seed, int64_t n, const BoundingBox& box, int64_t src_h, int64_t src_w,
                             int64_t canvas = kDistortedCanvas, const DistortionRanges& ranges = {});

/// Which source image training example n shows: uniform in [0, num_source) from (seed, n)
/// (sampling with replacement, so any prefix of the stream is a fair sample).
int64_t distorted_source_index(uint64_t seed, int64_t n, int64_t num_source);

/// A batch of distorted examples as floats, ready for a model.
struct DistortedBatch {
  torch::Tensor images;              // [B, 1, canvas, canvas] float in [0, 1]
  torch::Tensor labels;              // [B] int64
  torch::Tensor source_index;        // [B] int64: the source image each example shows
  std::vector<AffineParams> params;  // B maps (pixel coordinates, see affine_matrix)
};

/// The training stream: examples first .. first + count - 1, example n showing source image
/// distorted_source_index(seed, n, N) under draw_distortion(seed, n, ...). source: images [N, H, W]
/// uint8, labels [N]. Throws std::invalid_argument for a bad source, count <= 0 or first < 0.
DistortedBatch distorted_batch(const ImageSet& source, uint64_t seed, int64_t first, int64_t count,
                               int64_t canvas = kDistortedCanvas, const DistortionRanges& ranges = {});

/// A fixed test set: example i is source image i under draw_distortion(seed, i, ...), rounded to
/// uint8, so a prefix of the source gives a prefix of the set. Returns images [N, canvas, canvas].
ImageSet distorted_set(const ImageSet& source, uint64_t seed, int64_t canvas = kDistortedCanvas,
                       const DistortionRanges& ranges = {});

}  // namespace capsnet::data
