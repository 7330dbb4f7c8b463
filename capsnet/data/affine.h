#pragma once
// Data for the affine-robustness experiment of Sabour et al. (2017), Sec. 5.2: train on MNIST placed
// at random in a 40x40 canvas, test on affine-warped digits.
//
// The warped test set made here is affNIST-STYLE, NOT the real affNIST set (Tieleman's 40x40 set,
// which is not downloaded or used by this project): each MNIST test digit gets its own random affine
// map with our ranges (AffineRanges) and our sampler (bilinear), so accuracies on it are comparable
// between models evaluated here, not with the paper's 79% / 66%.
//
// Coordinates: pixel (x, y) = (column, row) has its centre at integer (x, y); y points down, so a
// positive rotation angle turns the digit counter-clockwise as seen on screen.

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "capsnet/data/mnist.h"

namespace capsnet::data {

/// Puts each image in the middle of a canvas x canvas black image, then shifts it by its own random
/// (dx, dy), each uniform in [-max_shift, max_shift] (the paper's affNIST training data: MNIST on a
/// 40x40 background at a random position). Nothing is cropped: max_shift may not exceed the border,
/// (canvas - H) / 2 and (canvas - W) / 2. images: [B, C, H, W] float. Returns [B, C, canvas, canvas].
/// Deterministic given the generator state (like random_shift; drawn on the CPU generator).
torch::Tensor place_in_canvas(const torch::Tensor& images, int64_t canvas, int64_t max_shift, at::Generator& gen);

/// The parameters of one affine map, applied in this order to coordinates relative to the source
/// centre: scale (scale_x, scale_y), then shear x += shear * y, then rotation by rotation_deg, then
/// the source centre goes to the canvas centre plus (tx, ty) pixels. Identity by default.
struct AffineParams {
  double rotation_deg = 0;
  double shear = 0;
  double scale_x = 1, scale_y = 1;
  double tx = 0, ty = 0;
};

/// Sampling ranges of the affNIST-style maps: rotation uniform in [-max_rotation_deg, max_rotation_deg],
/// shear coefficient uniform in [-max_shear, max_shear] (the off-diagonal entry of [[1, k], [0, 1]];
/// our choice, documented, not checked against affNIST's own parametrisation), each scale uniform in
/// [min_scale, max_scale] independently; translation: see draw_affine_params.
struct AffineRanges {
  double max_rotation_deg = 20;
  double max_shear = 0.1;
  double min_scale = 0.8, max_scale = 1.2;
  /// Throws std::invalid_argument naming the bad range.
  void validate() const;
};

/// Row-major 2x3 forward matrix A in pixel coordinates: a source pixel at (x, y) of a src_h x src_w
/// image lands at A * (x, y, 1) in an out_h x out_w canvas.
std::array<double, 6> affine_matrix(const AffineParams& params, int64_t src_h, int64_t src_w, int64_t out_h,
                                    int64_t out_w);

/// Warps images with the forward maps `forward` by inverse mapping: each output pixel q samples the
/// source at A^-1 q by bilinear interpolation, reading 0 outside the source. Inputs in [0, 1] give
/// outputs in [0, 1]. images: [B, C, H, W] float; forward: [B, 2, 3] (as from affine_matrix; any
/// float dtype, inverted in float64). Returns [B, C, out_h, out_w]. Throws for a singular map.
torch::Tensor warp_affine(const torch::Tensor& images, const torch::Tensor& forward, int64_t out_h, int64_t out_w);

/// Inclusive bounding box of the nonzero pixels of one image; empty = true when the image is black.
struct BoundingBox {
  int64_t x0 = 0, y0 = 0, x1 = -1, y1 = -1;
  bool empty() const { return x1 < x0 || y1 < y0; }
};
/// image: [H, W] (any dtype). Pixels > 0 count as digit.
BoundingBox bounding_box(const torch::Tensor& image);

/// Sets p.tx, p.ty (canvas pixels) from uniforms ux, uy in [0, 1): a translation uniform over those that
/// keep `box` of the src_h x src_w source, grown by the 1 px bilinear footprint and warped by `p`, inside
/// the canvas x canvas output; a box too large to fit is centred instead. `box` must not be empty.
void place_inside_canvas(AffineParams& p, const BoundingBox& box, int64_t src_h, int64_t src_w, int64_t canvas,
                         double ux, double uy);

/// The affNIST-style map of example `index` under `seed`: rotation, shear and scales drawn from
/// `ranges`, then a translation uniform over the positions that keep the warped digit's bounding box
/// (grown by the 1 px bilinear footprint) inside the canvas; a digit too large to fit is centred
/// instead (and cropped). A pure function of (seed, index, box, sizes, ranges): our own splitmix64
/// stream, identical on every platform and LibTorch version.
AffineParams draw_affine_params(uint64_t seed, int64_t index, const BoundingBox& box, int64_t src_h, int64_t src_w,
                                int64_t canvas, const AffineRanges& ranges = {});

/// affNIST-STYLE test set (not the real affNIST): every image of `source` ([N, H, W] uint8, e.g. the
/// MNIST test set) warped by draw_affine_params(seed, i, ...) into a canvas x canvas image, bilinear,
/// rounded to uint8. Labels are copied. Example i depends only on (seed, i, source image i), so a
/// prefix of the source gives a prefix of the set. Returns images [N, canvas, canvas] uint8.
ImageSet affine_test_set(const ImageSet& source, uint64_t seed, int64_t canvas = 40, const AffineRanges& ranges = {});

/// One test set of a robustness curve: the same test digits under one family of warps at one severity.
struct WarpSet {
  std::string family;  // "none", "rotation", "shear", "scale", "combined"
  std::string name;    // e.g. "rotation ±30°"
  double severity;     // the x of the family's curve: degrees, shear coefficient, scale spread d, or 1, 2
  AffineRanges ranges;
};

/// The robustness family of `capsnet affine`, 12 sets: translation only ("none"); rotation alone up to
/// ±10, 20, 30, 45°; shear alone up to ±0.1, 0.2, 0.4; each axis' scale alone in 1 ± 0.2, 1 ± 0.4; and two
/// combined settings (the affNIST-style AffineRanges{} and the same with shear ±0.2). Each set places the
/// warped digit uniformly inside the canvas (affine_test_set), so "none" is every curve's first point.
std::vector<WarpSet> robustness_family();

/// Translated-MNIST set: every image of `source` placed in a canvas x canvas image by place_in_canvas
/// with a generator seeded by `seed` (the test set of the paper's 40x40 translated-MNIST training
/// distribution). Returns images [N, canvas, canvas] uint8 (exact copies of the source pixels).
ImageSet translated_set(const ImageSet& source, uint64_t seed, int64_t canvas = 40, int64_t max_shift = 6);

}  // namespace capsnet::data
