#pragma once
// Training and evaluation of the SegCaps model on cluttered-digit segmentation (data/segmentation.h):
// Adam on the model's loss (class-weighted binary cross-entropy of the capsule length, plus the masked
// reconstruction regulariser when the config has one), fresh generated images every step, Dice on a
// fixed test set, the thresholding baseline, and the input | target | prediction figure.

#include <torch/torch.h>

#include <ostream>
#include <string>
#include <vector>

#include "capsnet/data/segmentation.h"
#include "capsnet/models/segcaps.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/train/loop.h"

namespace capsnet::experiments {

struct SegCapsTrainOptions {
  SegCapsTrainOptions() {
    loop.out_dir = "runs/segcaps";
    loop.epochs = 0;  // a run is measured in steps: loop.max_steps
    loop.max_steps = 1000;
    loop.batch_size = 16;
    loop.lr_decay = 1;  // no decay
    loop.checkpoint_every = 0;         // only at the end
    loop.evaluate_each_epoch = false;  // the test set is evaluated at the end
  }

  models::SegCapsConfig model;
  /// The loop's options (loop.h). loop.max_steps is the run's length in steps (loop.epochs 0); loop.seed
  /// seeds the model initialisation and the training images; loop.max_seconds > 0 is a wall-clock budget:
  /// training stops after the first step that ends past it and the model is evaluated as it is
  /// (result.steps says how many steps ran); loop.precision is the compute type of the convolutions
  /// (routing, losses fp32).
  train::LoopOptions loop;
  int64_t test_size = 500;
  int64_t eval_batch_size = 50;
  double threshold = 0.5;  // predicted mask = |v| > threshold
  /// Training digits the caller held out for validation (0 = none). Only recorded: in the checkpoint's data
  /// config, so that resuming with another split is refused.
  int64_t validation_size = 0;
  bool fused_routing = true;  // false: the composite ATen routing path (same math)

  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// Segmentation quality on `count` examples of a generator.
struct SegmentationEval {
  int64_t examples = 0;
  double mean_dice = 0;  // mean over images of the per-image Dice of (|v| > threshold) vs the target mask
  double loss = 0;       // mean model loss (weighted BCE + recon_weight * masked-reconstruction MSE)
  double seconds = 0;
};

/// Evaluates examples first_n .. first_n + count - 1 (no grad, eval mode).
SegmentationEval evaluate_segcaps(models::SegCaps& model, const data::DigitSegmentation& set, int64_t first_n,
                                  int64_t count, int64_t batch_size, double threshold);

/// The threshold grid of the thresholding baseline and of the validation choice: 0.05, 0.10, ..., 0.95.
std::vector<double> threshold_grid();

/// Mean Dice of (|v| > t) for every t of `thresholds`, on examples first_n .. first_n + count - 1 (one
/// forward pass per batch; no grad, eval mode). Element k equals evaluate_segcaps(..., thresholds[k]).mean_dice.
std::vector<double> dice_by_threshold(models::SegCaps& model, const data::DigitSegmentation& set, int64_t first_n,
                                      int64_t count, int64_t batch_size, const std::vector<double>& thresholds);

/// The capsule-length threshold chosen on held-out validation images (argmax of the validation Dice over
/// threshold_grid(); the first of equals), and the test Dice at it.
struct ValidatedThreshold {
  std::vector<double> thresholds, val_dice;  // the grid and the mean validation Dice at each threshold
  double best_threshold = 0.5;
  double val_dice_at_best = 0, test_dice_at_best = 0;
  int64_t val_examples = 0, test_examples = 0;
};

/// Chooses the threshold on `val_count` examples of `val` and scores it on `test_count` examples of `test`.
ValidatedThreshold choose_threshold(models::SegCaps& model, const data::DigitSegmentation& val, int64_t val_count,
                                    const data::DigitSegmentation& test, int64_t test_count, int64_t batch_size);

/// Thresholding baseline: predicted mask = input > t, Dice averaged over images.
struct ThresholdBaseline {
  std::vector<double> thresholds, train_dice;  // the grid and its mean Dice on the tuning examples
  double best_threshold = 0.5;                 // argmax of train_dice
  double test_dice_at_best = 0, test_dice_at_half = 0;
};

/// Tunes t over {0.05, 0.10, ..., 0.95} on `tune_count` examples of `tune`, reports on `count` examples of `test`.
ThresholdBaseline threshold_baseline(const data::DigitSegmentation& tune, int64_t tune_count,
                                     const data::DigitSegmentation& test, int64_t count);

/// The run's statistics (steps: fewer than options.loop.max_steps when loop.max_seconds stopped training) and:
struct SegCapsTrainResult : train::RunStats {
  models::SegCaps model{nullptr};
  SegmentationEval test;
};

/// Trains the model on the one loop (loop.h): OUT/metrics.jsonl ("train" records every log_every
/// steps, an "eval" record with the test Dice at the end), OUT/checkpoint.pt, exact resume, data
/// parallelism over `group`. Log lines go to `log`, the progress bar to stderr.
SegCapsTrainResult train_segcaps(const SegCapsTrainOptions& options, const data::DigitSegmentation& train_set,
                                 const data::DigitSegmentation& test_set, std::ostream& log,
                                 std::shared_ptr<train::ProcessGroup> group = nullptr);

/// Figure: one row per test example: input | target mask | probability |v| | predicted mask (|v| > threshold),
/// each zoomed by `zoom`. Returns float [rows * (S z + 2) + 2, 4 (S z + 2) + 2] in [0, 1].
torch::Tensor segcaps_figure(models::SegCaps& model, const data::DigitSegmentation& set, int64_t first_n, int64_t rows,
                             double threshold, int64_t zoom = 3);

}  // namespace capsnet::experiments
