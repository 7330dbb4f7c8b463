#pragma once
// MultiMNIST (Sabour et al. 2017, Sec. 6): two digits of different classes from the same split, each
// shifted by up to 4 px inside a 36x36 canvas, overlaid. Generated on the fly: example n is a pure
// function of (seed, n), so a 60M-image "epoch" needs no file and any example can be regenerated.

#include <torch/torch.h>

#include <array>
#include <string>
#include <vector>

#include "capsnet/data/mnist.h"

namespace capsnet::data {

/// How the two shifted digits are combined into the composite image.
enum class Overlay {
  /// min(a + b, 1): the authors' generator adds the two uint8 digits and clips at 255, so strokes that
  /// cross get brighter up to saturation (the paper's default here).
  kAddClip,
  /// max(a, b): what this project generated before the option existed (checkpoints without the key).
  kMax,
};

/// "add" | "max": the CLI spelling and the value stored in checkpoints.
const char* overlay_name(Overlay overlay);
/// Inverse of overlay_name. Throws std::invalid_argument naming the accepted values.
Overlay parse_overlay(const std::string& name);

struct MultiMnistOptions {
  /// Zero border added on every side of a source digit: canvas side = source side + 2 * pad (28 -> 36).
  int64_t pad = 4;
  /// Each digit is shifted by its own (dx, dy), each uniform in [-max_shift, max_shift]. Must be <= pad,
  /// so a shifted digit never leaves the canvas (no ink is clipped).
  int64_t max_shift = 4;
  /// Composite of the two shifted digits (default: the authors' add-and-clip).
  Overlay overlay = Overlay::kAddClip;
};

/// One generated pair, with how it was made (for tests and figures).
struct MultiMnistExample {
  torch::Tensor image;   // composite: [S, S] float in [0, 1], S = canvas side; `digits` overlaid (options.overlay)
  torch::Tensor digits;  // the two shifted digits alone: [2, S, S] float in [0, 1] (reconstruction targets)
  std::array<int64_t, 2> labels{};  // classes (a, b), a != b
  std::array<int64_t, 2> source{};  // indices of the two digits in the source set
  std::array<int64_t, 2> dx{}, dy{};  // shifts of each digit, pixels (positive = right / down)
};

/// A batch of consecutive examples [first_n, first_n + B).
struct MultiMnistBatch {
  torch::Tensor images;  // [B, 1, S, S] float in [0, 1]
  torch::Tensor digits;  // [B, 2, 1, S, S] float in [0, 1]
  torch::Tensor labels;  // [B, 2] int64, labels[:, 0] != labels[:, 1]
};

/// Bounding-box overlap of two digits (boxes of their non-zero pixels, inclusive, in pixels).
struct BoxOverlap {
  double iou = 0;           // |A ∩ B| / |A ∪ B| (intersection over union of the two box areas)
  double over_smaller = 0;  // |A ∩ B| / min(|A|, |B|): 1 when one box lies inside the other
  bool valid = false;       // false when either digit has no ink (then both ratios are 0)
};

/// Running sums of BoxOverlap over examples with two non-empty digits.
struct OverlapStats {
  int64_t examples = 0;  // examples counted (valid overlaps only)
  double sum_iou = 0, sum_over_smaller = 0;
  double mean_iou() const { return examples ? sum_iou / static_cast<double>(examples) : 0.0; }
  double mean_over_smaller() const { return examples ? sum_over_smaller / static_cast<double>(examples) : 0.0; }
};

/// Streamed MultiMNIST generator over one split (Sec. 6 of the paper).
///
/// Example n (any n >= 0), with N = source size:
///  - digit a is the source digit at position (n mod N) of a seeded pseudo-random permutation of the
///    source (a 4-round Feistel network with cycle walking, keyed by (seed, n div N)): every run of N
///    consecutive examples starting at a multiple of N uses each source digit exactly once as digit a,
///    in a new order each round (the paper pairs each digit with 1K others);
///  - digit b is drawn uniformly among the source digits whose class differs from a's;
///  - each digit is padded by `pad` and shifted by its own (dx, dy) ~ U{-max_shift..max_shift}^2;
///  - the composite overlays the two shifted digits: by default clamp(a + b, 0, 1), as the authors'
///    generator does (it adds the uint8 digits and clips at 255); Overlay::kMax takes the pixel-wise
///    max instead. Both equal either digit where the other has no ink and differ only where both have.
/// All choices come from a splitmix64 hash of (seed, n, purpose): no state, thread-safe, reproducible.
/// Nothing is stored beyond the source set and a class-sorted index of it (N int64).
class MultiMnist {
 public:
  /// source: images [N, H, H] uint8, labels [N] int64 with at least two distinct classes.
  /// Throws std::invalid_argument naming the bad shape, option or label set.
  MultiMnist(ImageSet source, uint64_t seed, MultiMnistOptions options = {});

  /// Side S of the square canvas (36 for MNIST).
  int64_t canvas_size() const { return side_ + 2 * options_.pad; }
  int64_t source_size() const { return source_.size(); }
  uint64_t seed() const { return seed_; }
  const MultiMnistOptions& options() const { return options_; }

  /// Example n >= 0 (throws std::invalid_argument for n < 0).
  MultiMnistExample example(int64_t n) const;

  /// Examples first_n .. first_n + count - 1 (first_n >= 0, count >= 1), identical to example(n) for each n.
  MultiMnistBatch generate(int64_t first_n, int64_t count) const;

 private:
  struct Choice {
    std::array<int64_t, 2> source, dx, dy;
  };
  Choice choose(int64_t n) const;

  ImageSet source_;
  uint64_t seed_;
  MultiMnistOptions options_;
  int64_t side_ = 0;
  std::vector<int64_t> by_class_;     // source indices sorted by class (stable)
  std::vector<int64_t> class_begin_;  // by_class_[class_begin_[k] .. class_begin_[k + 1]) have class k
};

/// Bounding-box overlap of two single-digit images a, b: [H, W] (any dtype; ink = value > 0).
BoxOverlap box_overlap(const torch::Tensor& a, const torch::Tensor& b);

/// Adds the overlaps of a batch's digit pairs to running stats. digits: [B, 2, 1, S, S] or [B, 2, S, S].
void accumulate_overlap(OverlapStats& stats, const torch::Tensor& digits);

/// Overlap statistics of examples first_n .. first_n + count - 1 of a generator.
OverlapStats overlap_stats(const MultiMnist& generator, int64_t first_n, int64_t count, int64_t batch_size = 500);

}  // namespace capsnet::data
