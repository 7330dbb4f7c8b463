#pragma once
// Training and evaluation on MultiMNIST (Sabour et al. 2017, Sec. 6): margin loss with two targets,
// each digit reconstructed from its own capsule, classification by the two longest capsules.

#include <torch/torch.h>

#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "capsnet/data/multimnist.h"
#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/train/loop.h"

namespace capsnet::experiments {

/// Which model a MultiMNIST run trains.
enum class MultiMnistModel {
  kCapsNet,  // the paper's CapsNet: two-target margin loss, each digit reconstructed from its capsule
  kCnn,      // the baseline CNN (models/baseline_cnn.h) with a sigmoid per class: multi-label BCE
};
/// "capsnet" | "cnn"; parse_multimnist_model throws std::invalid_argument naming the text.
const char* multimnist_model_name(MultiMnistModel model);
MultiMnistModel parse_multimnist_model(const std::string& name);

struct MultiMnistTrainOptions {
  MultiMnistTrainOptions() {
    loop.out_dir = "runs/multimnist";  // checkpoint.pt and metrics.jsonl go here
    loop.epochs = 0;                   // a run is measured in steps: loop.max_steps
    loop.max_steps = 1000;
    loop.batch_size = 50;
    loop.lr_decay = 0.96;              // multiplied into lr per 60,000 training pairs, applied smoothly per step
    loop.checkpoint_every = 0;         // only at the end
    loop.evaluate_each_epoch = false;  // the test pairs are evaluated at the end (and every loop.eval_every steps)
  }

  MultiMnistModel which = MultiMnistModel::kCapsNet;
  models::CapsNetConfig model;  // image_size must be the generator's canvas side (36 for MNIST)
  models::BaselineCnnConfig cnn;  // with which == kCnn; image_size likewise the canvas side
  /// The loop's options (loop.h). loop.max_steps is the run's length in steps (loop.epochs 0); loop.seed
  /// seeds the model initialisation (the pairs come from the generator's own seed); loop.eval_every > 0 also
  /// evaluates the test pairs every this many steps (a learning curve).
  train::LoopOptions loop;
  int64_t test_size = 10000;  // generated test pairs evaluated at the end (0 = none)
  int64_t eval_batch_size = 100;
  bool fused_routing = true;

  /// Throws std::invalid_argument naming the first bad option.
  void validate() const;
  /// {task, model, steps (= loop.max_steps), batch_size, lr, lr_decay, seed, test_size, out_dir}.
  nlohmann::json to_json() const;
};

/// The overlay a MultiMNIST checkpoint's training pairs used, from its saved train options
/// (train_generator.overlay; missing = Overlay::kMax, what checkpoints from before the option used).
/// Throws std::invalid_argument for an unknown value.
data::Overlay saved_overlay(const nlohmann::json& train_options);

/// One forward pass with both digits decoded.
struct MultiMnistForward {
  models::CapsNetOutput out;     // digit_caps v: [B, K, D], lengths: [B, K]
  torch::Tensor reconstructions;  // [B, 2, C*S*S]: decoded from the capsules `which`; undefined without a decoder
};

struct MultiMnistLoss {
  torch::Tensor total, margin, reconstruction;  // scalars
};

/// Runs the model on images [B, C, S, S] and decodes, for each example, the capsule of class which[b][0]
/// and, separately, the capsule of class which[b][1] (each masked alone). which: [B, 2] int64.
MultiMnistForward forward_pair(models::CapsNet& model, const torch::Tensor& images, const torch::Tensor& which);

/// Margin loss with both classes present (T_a = T_b = 1) plus reconstruction_scale * (SSE(rec_a, digit_a) +
/// SSE(rec_b, digit_b)), each SSE summed over pixels and averaged over the batch, as reconstruction_loss.
/// labels: [B, 2] (a != b); digits: [B, 2, C, S, S] targets; f from forward_pair(model, images, labels).
MultiMnistLoss multimnist_loss(const models::CapsNetConfig& config, const MultiMnistForward& f,
                               const torch::Tensor& labels, const torch::Tensor& digits);

/// The CNN baseline's loss: a sigmoid per class against the two-hot target (both classes present),
/// binary cross-entropy summed over the K classes and averaged over the batch. logits: [B, K];
/// labels: [B, 2] (a != b). Scores for both_found are the logits.
torch::Tensor multimnist_cnn_loss(const torch::Tensor& logits, const torch::Tensor& labels);

/// The two longest capsules, longest first. lengths: [B, K] (K >= 2) -> [B, 2] int64.
torch::Tensor two_longest(const torch::Tensor& lengths);

/// The paper's MultiMNIST metric: example b is correct when its two longest capsules are exactly the
/// classes {labels[b][0], labels[b][1]} (in either order). lengths: [B, K]; labels: [B, 2] -> [B] bool.
torch::Tensor both_found(const torch::Tensor& lengths, const torch::Tensor& labels);

struct MultiMnistEval {
  int64_t examples = 0;
  double accuracy = 0;        // fraction with both digits found (error = 1 - accuracy)
  double digit_accuracy = 0;  // fraction of the 2 * examples labels that are among the two longest capsules
  double loss = 0;            // mean total loss, reconstructing from the true labels (as in training)
  data::OverlapStats overlap;  // bounding-box overlap of the evaluated pairs
  double seconds = 0;
};

/// Evaluates on examples 0 .. count - 1 of `pairs` in batches, without gradients.
MultiMnistEval evaluate_multimnist(models::CapsNet& model, const data::MultiMnist& pairs, int64_t count,
                                   int64_t batch_size, std::ostream* progress = nullptr);
/// The same for the CNN baseline: its two largest logits are its two digits; loss = multimnist_cnn_loss.
MultiMnistEval evaluate_multimnist(models::BaselineCnn& model, const data::MultiMnist& pairs, int64_t count,
                                   int64_t batch_size, std::ostream* progress = nullptr);

/// The run's statistics (images_seen: pairs) and:
struct MultiMnistTrainResult : train::RunStats {
  std::optional<MultiMnistEval> test;
};

/// Trains the model options.which names (a CapsNet or the baseline CNN) with Adam on pairs
/// 0 .. loop.max_steps * loop.batch_size - 1 of `train_pairs` (step s uses examples [s * B, (s + 1) * B): never a
/// repeated pair below 60M images when the source is MNIST's train split), then evaluates on the first options.test_size pairs of `test_pairs` (may be null).
/// Runs on the one loop (loop.h): OUT/metrics.jsonl, OUT/checkpoint.pt, exact resume, and data
/// parallelism over `group`. Throws train::TrainingDiverged when the loss stops being finite.
MultiMnistTrainResult train_multimnist(const MultiMnistTrainOptions& options, const data::MultiMnist& train_pairs,
                                       const data::MultiMnist* test_pairs, std::ostream& log,
                                       std::shared_ptr<train::ProcessGroup> group = nullptr);

/// Orders the two predicted classes to line up with the labels for display: a predicted class equal to
/// a label goes in that label's slot. predicted, labels: pairs of classes.
std::array<int64_t, 2> align_to_labels(std::array<int64_t, 2> predicted, std::array<int64_t, 2> labels);

/// One panel of the paper's Fig. 5 in grayscale, side by side (zoom z, S = canvas side, g = 2 px gaps):
///   a caption row of height 5 * t + 4 reading "R:(r1,r2) L:(l1,l2)" (t = 2 when it fits, else 1;
///   dimmer when {r1, r2} != {l1, l2}), then [input | reconstruction from r1 | reconstruction from r2],
///   each S*z x S*z. Size: [5t + 4 + S*z, 3*S*z + 2g]. image: [S, S]; reconstructions: [2, S, S].
torch::Tensor multimnist_panel(const torch::Tensor& image, const torch::Tensor& reconstructions,
                               std::array<int64_t, 2> reconstructed_from, std::array<int64_t, 2> labels,
                               int64_t zoom = 2);

/// A figure of `correct` correctly classified and then `wrong` misclassified test pairs (the first ones
/// found among examples 0 .. scan_limit - 1 of `pairs`), each reconstructed from its two longest capsules,
/// tiled `columns` panels per row with 4 px padding. Fewer panels when the scan finds too few; throws
/// std::invalid_argument when it finds none or the model has no decoder. Returns float [H, W] in [0, 1].
torch::Tensor multimnist_figure(models::CapsNet& model, const data::MultiMnist& pairs, int64_t correct,
                                int64_t wrong, int64_t columns = 3, int64_t scan_limit = 2000);

}  // namespace capsnet::experiments
