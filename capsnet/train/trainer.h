#pragma once
// The paper's MNIST experiment as a Task of the one loop (loop.h): CapsNet on randomly shifted images,
// Adam with an exponentially decaying learning rate. `capsnet train` runs it.

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "capsnet/data/mnist.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/train/evaluate.h"
#include "capsnet/train/loop.h"

namespace capsnet::train {

struct TrainOptions {
  TrainOptions() { loop.out_dir = "runs/mnist"; }

  models::CapsNetConfig model;
  /// The loop's options (loop.h): out_dir (default "runs/mnist"), epochs, max_steps, batch_size, lr, the
  /// schedule (one-cycle: lr is the peak), seed, checkpoint_every, log_every, evaluate_each_epoch, resume,
  /// progress, precision (compute type of the convolutions and decoder), ...
  LoopOptions loop;
  /// > 0: the last validation_size training examples are held out as a validation split, evaluated at
  /// every epoch end beside the test set; the best epoch's checkpoint is kept as best.pt (loop.h).
  int64_t validation_size = 0;
  int64_t max_shift = 2;      // random translation, pixels in each direction
  bool hflip = false;         // mirror each training image left-right with probability 1/2 (not for digits)
  // The epoch-end evaluation's batch: the training batch's size, so that it fits in the pages the training
  // steps use (at 250 it set the run's peak: capsnet train fp32 966 -> 673 MB, bf16 690 -> 544; the same time).
  int64_t eval_batch_size = 100;
  bool fused_routing = true;  // the fused routing operator (false: composite ops; same math)
  /// How the data became model inputs, kept in the checkpoint for predict / eval / serve (image folders:
  /// {"image_fit": "resize" | "pad", "data": DIR}). The training set's class names are stored beside it.
  nlohmann::json data_info = nlohmann::json::object();

  /// Throws std::invalid_argument naming the first bad option.
  void validate() const;
  /// loop.to_json(), max_shift and hflip.
  nlohmann::json to_json() const;
};

/// The run's statistics (steps: the last step trained; checkpoint: the last written) and:
struct TrainResult : RunStats {
  int64_t start_step = 0;          // the step this run began at (> 0 after a resume)
  std::optional<EvalResult> test;  // last evaluation, when a test set was given
  std::optional<EvalResult> validation;  // last validation, when validation_size > 0
  std::optional<double> best_validation_accuracy;  // and the step of best.pt
  int64_t best_validation_step = 0;
};

/// Trains a CapsNet on `train_set` (less its last validation_size examples, the validation split),
/// evaluating on the validation split and on `test_set` (may be null) at each epoch end.
/// Log lines go to `log`; the progress bar to stderr.
/// With a `group` of W processes (data parallel, docs/distributed.md): every rank draws the same
/// global batch of batch_size examples and the same shifts, takes its rank_slice of the rows, and
/// the gradients are averaged so the update equals one process's on the whole batch (up to float
/// reassociation). Only rank 0 logs, evaluates and writes metrics and checkpoints.
TrainResult train(const TrainOptions& options, const data::ImageSet& train_set, const data::ImageSet* test_set,
                  std::ostream& log, std::shared_ptr<ProcessGroup> group = nullptr);

}  // namespace capsnet::train
