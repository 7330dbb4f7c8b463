#pragma once
// Training and evaluation of the matrix-capsule network (EM routing) with the spread loss
// (Hinton, Sabour & Frosst 2018, Sec. 3.1 and 5): Adam, margin m annealed linearly 0.2 -> 0.9.

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "capsnet/data/mnist.h"
#include "capsnet/models/matrix_capsnet.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/train/loop.h"

namespace capsnet::experiments {

/// The paper's spread-loss margin at the end of training (Sec. 3.1: annealed from 0.2 to 0.9); the
/// margin at which a trained model's loss is reported.
inline constexpr double kFinalSpreadMargin = 0.9;

struct EmTrainOptions {
  EmTrainOptions() {
    loop.out_dir = "runs/em";  // metrics.jsonl and checkpoint.pt go here
    loop.epochs = 0;           // a run is measured in steps: loop.max_steps
    loop.max_steps = 500;
    loop.batch_size = 32;
    loop.lr = 3e-3;            // Adam
    loop.lr_decay = 1.0;       // once per epoch, applied smoothly per step (1 = constant, the paper's setting:
                               // it anneals the margin instead)
    loop.log_every = 20;
    loop.checkpoint_every = 0;         // only at epoch ends and at the end
    loop.evaluate_each_epoch = false;  // the test images are evaluated at the end (and every loop.eval_every steps)
  }

  models::MatrixCapsNetConfig model;
  /// The loop's options (loop.h). loop.max_steps is the run's length in steps (loop.epochs 0), which the
  /// margin schedule spans; loop.weight_decay is L2 on all parameters (Adam's); loop.seed seeds the
  /// initialisation and the order of the training examples; loop.eval_every > 0 also evaluates test_size
  /// test images every this many steps (a learning curve); loop.max_seconds > 0 stops after the first step
  /// past this much training time (then evaluates), so the margin stops short of margin_end; loop.precision
  /// is the compute type of the convolutions (routing stays fp32).
  train::LoopOptions loop;
  double margin_start = 0.2;    // spread-loss margin at step 0 ...
  double margin_end = kFinalSpreadMargin;  // ... reached at the last step (linear)
  int64_t max_shift = 0;        // random translation of each training image, pixels in each direction (zero
                                // padding; 0 = none, the paper's setting; 2 = CapsNet's MNIST augmentation)
  int64_t train_size = 0;       // first examples of the training split used (0 = all)
  int64_t test_size = 10000;    // first test examples evaluated at the end (0 = none)
  int64_t eval_batch_size = 100;

  /// Throws std::invalid_argument naming the first bad option.
  void validate() const;
  /// The loop's and the experiment's options ("steps" = loop.max_steps), as written by `capsnet em`.
  nlohmann::json to_json() const;
};

struct EmEval {
  int64_t examples = 0;
  double accuracy = 0;  // argmax of the class activations == label
  double loss = 0;      // mean spread loss at margin m
  double seconds = 0;
  torch::Tensor confusion;  // [K, K] int64, rows = true label, columns = prediction
};

/// The run's statistics (losses: the spread loss of every step; checkpoint: OUT/checkpoint.pt) and:
struct EmTrainResult : train::RunStats {
  models::MatrixCapsNet model{nullptr};  // as trained, in the run's precision
  double final_train_accuracy = 0;       // over the last log_every steps
  EmEval test;                           // examples == 0 when test_size == 0 or no test set
};

/// Images [N, H, W] uint8 -> [N, 1, H, W] float in [0, 1].
torch::Tensor to_input(const torch::Tensor& images);

/// Evaluates the first `count` examples of `set` (all when count <= 0) without gradients.
EmEval evaluate_em(models::MatrixCapsNet& model, const data::ImageSet& set, int64_t count, int64_t batch_size,
                   double margin, std::ostream* progress = nullptr);

/// Trains a MatrixCapsNet with Adam on `train_set` (a seeded order per epoch), spread-loss margin
/// from spread_margin(step, steps, margin_start, margin_end), then evaluates on `test_set` (may be
/// null). Runs on the one loop (loop.h): OUT/metrics.jsonl, OUT/checkpoint.pt, exact resume, data
/// parallelism over `group`. Throws train::TrainingDiverged when the loss stops being finite.
EmTrainResult train_em(const EmTrainOptions& options, const data::ImageSet& train_set, const data::ImageSet* test_set,
                       std::ostream& log, std::shared_ptr<train::ProcessGroup> group = nullptr);

}  // namespace capsnet::experiments
