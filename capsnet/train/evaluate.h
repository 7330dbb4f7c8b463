#pragma once

#include <torch/torch.h>

#include <ostream>
#include <vector>

#include "capsnet/data/mnist.h"
#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"

namespace capsnet::train {

struct EvalResult {
  int64_t examples = 0;
  double accuracy = 0;      // fraction correct; prediction = longest capsule (CapsNet), largest logit (CNN)
  double loss = 0;          // mean training loss: margin + scaled reconstruction (CapsNet), cross-entropy (CNN)
  torch::Tensor confusion;  // [K, K] int64, rows = true label, columns = prediction
};

/// Evaluates on unshifted images in batches, without gradients. `progress` (may be null) gets a bar.
EvalResult evaluate(models::CapsNet& model, const data::ImageSet& set, int64_t batch_size,
                    std::ostream* progress = nullptr);
/// The same for the baseline CNN (prediction = largest logit, loss = cross-entropy).
EvalResult evaluate(models::BaselineCnn& model, const data::ImageSet& set, int64_t batch_size,
                    std::ostream* progress = nullptr);

/// An ensemble of CapsNets scored together, and each member alone on the same images.
struct EnsembleResult {
  EvalResult ensemble;                  // loss: NaN (an ensemble has no training loss)
  std::vector<double> member_accuracy;  // models[m] alone
};

/// Evaluates CapsNets of one class count as an ensemble: an image's class scores are its capsule lengths
/// (the paper's class probabilities) averaged over the models, the prediction their argmax (ties: the
/// lowest class, as argmax). Each model's own accuracy on the same batches comes with it. Eval mode, no
/// gradients; every model's mode is restored. std::invalid_argument for no models or differing class counts.
EnsembleResult evaluate_ensemble(std::vector<models::CapsNet>& models, const data::ImageSet& set,
                                 int64_t batch_size, std::ostream* progress = nullptr);

/// The confusion matrix as an aligned text table with per-class accuracy.
std::string format_confusion(const torch::Tensor& confusion);

}  // namespace capsnet::train
