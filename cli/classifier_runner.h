#pragma once
// Model-agnostic training/evaluation helpers for the CLI experiments that compare CapsNet with the
// baseline CNN on generated image sets (capsnet stn; the same shape as capsnet affine's runners).

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <utility>

#include "capsnet/data/mnist.h"
#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/nn/spatial_transformer.h"
#include "capsnet/train/metrics.h"

namespace capsnet::cli {

/// What an experiment needs from a classifier, whichever it is.
struct ClassifierRunner {
  std::string name;
  int64_t parameters = 0;
  nlohmann::json config;
  std::function<void(bool)> set_training;
  /// One optimisation step on images [B, C, S, S] and labels [B]; returns (loss, correct).
  std::function<std::pair<double, int64_t>(const torch::Tensor&, const torch::Tensor&)> step;
  /// Predicted classes [B] for images [B, C, S, S].
  std::function<torch::Tensor(const torch::Tensor&)> predict;
  /// The model's spatial transformer (output and theta for images [B, C, S, S]); empty without one.
  std::function<nn::SpatialTransformerOutput(const torch::Tensor&)> transformer;
};

/// CapsNet with Adam(lr), margin + scaled reconstruction loss; initialised after torch::manual_seed(seed).
ClassifierRunner capsnet_classifier(const std::string& name, const models::CapsNetConfig& config, double lr,
                                    uint64_t seed);
/// Baseline CNN with Adam(lr), cross-entropy; initialised after torch::manual_seed(seed).
ClassifierRunner cnn_classifier(const std::string& name, const models::BaselineCnnConfig& config, double lr,
                                uint64_t seed);

/// Training summary of run_training.
struct TrainingStats {
  int64_t steps = 0, images = 0;
  double seconds = 0, final_loss = 0, final_accuracy = 0;  // final_*: mean over the last 10% of steps
};

/// `steps` optimisation steps, step s on batch(s) = (images [B, C, S, S], labels [B]); a progress bar
/// on stderr, a {"event": "train", "model", "step", "loss", "accuracy", "images_per_second"} record every
/// log_every steps. Throws train::TrainingDiverged when the loss stops being finite.
TrainingStats run_training(ClassifierRunner& r, int64_t steps,
                           const std::function<std::pair<torch::Tensor, torch::Tensor>(int64_t)>& batch,
                           int64_t log_every, bool progress, train::JsonLinesWriter& metrics);

/// Accuracy on a uint8 image set ([N, S, S]), in eval mode, batches of batch_size.
double classifier_accuracy(ClassifierRunner& r, const data::ImageSet& set, int64_t batch_size, bool progress,
                           const std::string& label);

}  // namespace capsnet::cli
