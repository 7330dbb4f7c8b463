#pragma once
#include <torch/torch.h>

#include <ostream>

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

/// The confusion matrix as an aligned text table with per-class accuracy.
std::string format_confusion(const torch::Tensor& confusion);

}  // namespace capsnet::train
