#pragma once
// What the dimensions of a digit capsule encode (Sabour et al. 2017, Sec. 5.1 and Fig. 4): add a
// small offset to one dimension of the capsule of a digit, decode, and watch the reconstruction change.

#include <torch/torch.h>

#include <optional>
#include <vector>

#include "capsnet/models/capsnet.h"

namespace capsnet::viz {

/// The paper's offsets: -0.25, -0.20, ..., +0.25 (11 values, steps of 0.05; the middle one is exactly 0).
std::vector<double> default_perturbation_offsets();

/// `steps` offsets on each side of 0: (i - steps) * max_offset / steps for i = 0..2*steps.
/// Throws std::invalid_argument unless max_offset > 0 and steps >= 1.
std::vector<double> symmetric_offsets(double max_offset, int64_t steps);

struct PerturbationOptions {
  /// Added in turn to v[capsule, d]; any order, at least one value.
  std::vector<double> offsets = default_perturbation_offsets();
  /// The digit capsule to perturb (e.g. the label); nullopt: the predicted (longest) capsule.
  std::optional<int64_t> capsule;
};

/// The result of perturb_capsule for one image. D = digit_dim, O = offsets.size(), H = W = image_size.
struct Perturbation {
  torch::Tensor digit_caps;       // v: [J, D], the unmodified capsules of the image
  torch::Tensor lengths;          // |v_j|: [J]
  int64_t prediction = -1;        // argmax_j |v_j|
  int64_t capsule = -1;           // k, the capsule that was perturbed
  std::vector<double> offsets;    // [O]
  torch::Tensor reconstructions;  // [D, O, H, W] in (0, 1): row d decodes v with v[k, d] += offsets[o]
};

/// Computes the capsules v of one image and decodes, for every dimension d of capsule k and every
/// offset, the capsule mask(v with v[k, d] += offset, k), all D * O of them in a single decoder call,
/// without gradients, in eval mode (the model's training flag is restored afterwards).
/// image: [1, H, W] or [H, W] float in [0, 1] with H = W = model->config.image_size.
/// Throws c10::Error naming the bad value for a wrong shape, type or range, a capsule outside
/// [0, num_classes), an empty offset list, or a model without a decoder or with more than one channel.
Perturbation perturb_capsule(models::CapsNet& model, const torch::Tensor& image,
                             const PerturbationOptions& options = {});

/// How much each dimension matters: the mean absolute pixel difference between the reconstructions
/// at the largest and at the smallest offset. Returns [D] float.
torch::Tensor dimension_sensitivity(const Perturbation& perturbation);

/// Figure layout constants shared by perturbation_figure and its callers (e.g. tests).
struct PerturbationFigureLayout {
  int64_t zoom = 2;     // each reconstruction pixel becomes zoom x zoom
  int64_t pad = 2;      // pixels between and around the cells
  bool captions = true; // offsets above the columns, dimension numbers left of the rows
  /// Font scale of the captions: 2 when a zoomed cell is at least 40 px wide, else 1.
  int64_t caption_scale(int64_t cell_width) const { return cell_width >= 40 ? 2 : 1; }
};

/// Tiles the reconstructions into a D-row x O-column grid (viz::tile; row d = dimension d, column
/// o = offsets[o]) on a black canvas. With captions, a top band of 5*s + 4 px shows each offset
/// ("-.25", "0", "+.05", ...) centred over its column, and a left band of text_width(to_string(D-1), s)
/// + 2*s px shows each dimension number, s = caption_scale(W * zoom).
/// Returns float [top + D*(H*zoom + pad) + pad, left + O*(W*zoom + pad) + pad] in [0, 1].
torch::Tensor perturbation_figure(const Perturbation& perturbation, const PerturbationFigureLayout& layout = {});

/// Offset caption text: "-.25", "-.05", "0", "+.10" (two decimals, leading zero dropped).
std::string offset_label(double offset);

}  // namespace capsnet::viz
