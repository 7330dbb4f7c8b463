#pragma once
// Image classification as a Task of the one loop (loop.h): any classifier (CapsNet or the baseline CNN,
// with or without a spatial transformer) on any labelled-image source. `capsnet train` (trainer.h) trains
// CapsNet on MNIST-format data with it; the comparison experiments (`capsnet affine`, `capsnet stn`) train
// each of their models with it.

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

#include "capsnet/data/mnist.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/nn/spatial_transformer.h"
#include "capsnet/train/evaluate.h"
#include "capsnet/train/loop.h"

namespace capsnet::train {

/// What training and scoring need from a classifier, whichever it is.
struct Classifier {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  nlohmann::json config;
  /// Whether a checkpoint's saved model config builds this classifier (resume); empty: equal to `config`.
  std::function<bool(const nlohmann::json&)> config_matches;
  /// Training loss on images [B, C, S, S] and labels [B], with an "accuracy" scalar (and the loss's terms).
  std::function<TaskLoss(const torch::Tensor&, const torch::Tensor&)> loss;
  /// Predicted classes [B] for images [B, C, S, S].
  std::function<torch::Tensor(const torch::Tensor&)> predict;
  /// Accuracy, loss and confusion on a labelled set in eval mode (evaluate.h).
  std::function<EvalResult(const data::ImageSet&, int64_t batch_size, std::ostream* progress)> evaluate;
  /// The model's spatial transformer (output and theta); empty without one.
  std::function<nn::SpatialTransformerOutput(const torch::Tensor&)> transformer;
};

/// CapsNet: margin + scaled reconstruction loss (scalars "margin_loss", "reconstruction_loss", "accuracy"),
/// prediction = the longest capsule; convolutions and decoder computed at `precision` (models/capsnet.h);
/// routing by the fused operator or by composite ops (`fused_routing`, the same maths). A checkpoint's
/// config matches by models::same_config.
Classifier capsnet_classifier(const std::string& name, const models::CapsNetConfig& config,
                              Precision precision = Precision::kFloat32, bool fused_routing = true);
/// Baseline CNN: cross-entropy, prediction = argmax of the logits; convolutions and fully connected
/// layers computed at `precision` (models/baseline_cnn.h).
Classifier cnn_classifier(const std::string& name, const models::BaselineCnnConfig& config,
                          Precision precision = Precision::kFloat32);

/// Labelled images [B, C, S, S] float and labels [B] for the examples `ids` of a step, drawn with the
/// step's generator `gen` (placement, distortion).
using LabelledBatchSource =
    std::function<std::pair<torch::Tensor, torch::Tensor>(const torch::Tensor& ids, at::Generator& gen)>;

/// The rows `ids` of a uint8 image set, each shifted by up to `max_shift` pixels (data::random_shift), then
/// with `hflip` mirrored left-right with probability 1/2 (data::random_hflip; its draws follow the shifts', so
/// without it the batches are those of a run that predates it).
LabelledBatchSource shifted_batches(const data::ImageSet& set, int64_t max_shift, bool hflip = false);

/// A held-out evaluation of the classifier being trained (e.g. accuracy on a fixed test set), run by
/// the loop at epoch ends; its record's "accuracy" is what LoopOptions::target_accuracy checks.
using ClassifierEvaluator = std::function<Evaluation(Classifier&, std::ostream* progress)>;

/// An evaluator scoring accuracy on a fixed image set (held by reference: it must outlive the evaluator);
/// its record: {"split": split, "accuracy", "error", "examples"}, its summary "<label> accuracy A% (N images)".
ClassifierEvaluator accuracy_evaluator(const data::ImageSet& set, const std::string& split, const std::string& label,
                                       int64_t batch_size);

/// An evaluator scoring accuracy and loss by Classifier::evaluate (held by reference, like the above);
/// its record: {"accuracy", "error", "loss", "examples"}, its summary "<label> loss L accuracy A% (N images)";
/// each result is also stored in `last` (may be null).
ClassifierEvaluator loss_evaluator(const data::ImageSet& set, const std::string& label, int64_t batch_size,
                                   std::optional<EvalResult>* last = nullptr);

class ClassifierTask : public Task {
 public:
  /// `name` names the task in checkpoints (a resume must match it) and messages; `make` builds the
  /// classifier at the loop's precision (called by the loop after seeding); `epoch_size` examples per
  /// epoch, visited in a shuffled order (shuffle) or as a stream; `data_config` fixes the source for
  /// resume; `evaluator` (may be empty: nothing to evaluate) is the end-of-epoch evaluation.
  ClassifierTask(std::string name, std::function<Classifier(Precision)> make, int64_t epoch_size, bool shuffle,
                 LabelledBatchSource source, nlohmann::json data_config, ClassifierEvaluator evaluator = {});

  /// Evaluation on a validation split held out of the training data (run before `evaluator` at the same
  /// points): the loop keeps the best-validation checkpoint as best.pt and checks the target accuracy on it.
  void set_validation(ClassifierEvaluator validator) { validator_ = std::move(validator); }

  std::string name() const override { return name_; }
  std::shared_ptr<torch::nn::Module> build_model(Precision precision) override;
  nlohmann::json model_config() const override { return classifier_.config; }
  bool config_matches(const nlohmann::json& saved) const override;
  nlohmann::json data_config() const override { return data_config_; }
  /// The classifier's name once built (the start line: "capsnet: 8215568 parameters, ...").
  std::string describe() const override { return label(); }
  /// The classifier's name once built ("capsnet", "cnn+stn"), else name().
  std::string label() const override { return classifier_.name.empty() ? name_ : classifier_.name; }
  int64_t epoch_size() const override { return epoch_size_; }
  bool shuffle() const override { return shuffle_; }
  Batch batch(const torch::Tensor& ids, at::Generator& gen) const override;
  TaskLoss loss(const Batch& rows) override { return classifier_.loss(rows[0], rows[1]); }
  std::optional<Evaluation> evaluate(std::ostream* progress) override;
  std::optional<Evaluation> evaluate_validation(std::ostream* progress) override;

  /// The classifier the loop trained (valid after build_model).
  Classifier& classifier() { return classifier_; }

 private:
  std::string name_;
  std::function<Classifier(Precision)> make_;
  Classifier classifier_;
  int64_t epoch_size_;
  bool shuffle_;
  LabelledBatchSource source_;
  nlohmann::json data_config_;
  ClassifierEvaluator evaluator_, validator_;
};

/// Accuracy of `c` on a uint8 image set ([N, C, S, S]) in eval mode, in batches; a progress bar on
/// `progress` when not null.
double classifier_accuracy(Classifier& c, const data::ImageSet& set, int64_t batch_size, std::ostream* progress,
                           const std::string& label);

}  // namespace capsnet::train
