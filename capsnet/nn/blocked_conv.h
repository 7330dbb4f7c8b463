#pragma once
// Inference convolutions on oneDNN's blocked tensors, with the weights reordered once.
//
// A plain NCHW convolution through ATen pays, on every call, oneDNN reorders of its input into the
// blocked layout (nChw16c), of its output back to NCHW, and of its weights into the layout the kernel
// wants (21 MB for PrimaryCaps). At batch 1 the weight reorder is most of the call. Without autograd
// (inference) none of that is needed: the weights are reordered once and kept until the fp32 master
// changes (its version counter or its storage, i.e. after an optimizer step or a load), and a
// convolution's blocked output feeds the next convolution (Conv1 -> ReLU -> PrimaryCaps) directly.
// Training keeps the plain path: autograd has no formulas for blocked tensors in LibTorch 1.13.
// Cost: one blocked copy of each convolution's weights stays with its module once it has inferred
// (PrimaryCaps: 21 MB in fp32, 10.6 MB in bf16); where inference runs PrimaryCaps through DFTs (batches
// from kSpectralInferenceMinBatch on), its weight spectrum instead (100 MB fp32, 50 MB bf16).

#include <torch/torch.h>

#include <array>
#include <mutex>

#include "capsnet/nn/tensor_stamp.h"

namespace capsnet::nn {

/// One convolution's weights in oneDNN's blocked layout, and the inference forward that uses them.
/// Owned by the module whose convolution it serves; safe to call from several threads.
class BlockedConvWeights {
 public:
  BlockedConvWeights() = default;
  // A copy (of a cloned module) starts empty: it serves another module's weights.
  BlockedConvWeights(const BlockedConvWeights&) {}
  BlockedConvWeights& operator=(const BlockedConvWeights&);

  /// True when conv(x) may run blocked: autograd is not recording, x is a CPU tensor (dense or
  /// blocked) in fp32 or `dtype`, the weights are fp32, dtype is fp32 or bf16, and conv has groups 1
  /// and numeric zero padding. A float64 model always takes the plain path.
  static bool usable(const torch::nn::Conv2d& conv, const torch::Tensor& x, torch::ScalarType dtype);

  /// y = conv(x) in `dtype` with the cached blocked weights. x: [B, C, H, W], dense (any float dtype)
  /// or blocked in `dtype`. Returns y: [B, O, H', W'] as a blocked (is_mkldnn) tensor in `dtype`.
  torch::Tensor forward(const torch::nn::Conv2d& conv, const torch::Tensor& x, torch::ScalarType dtype);

  /// How many times the weights were reordered (tests: once per weight update, not per call).
  int64_t reorders() const;

  /// The spectral form's counterpart (nn/spectral_conv.h): w^T's spectrum for conv2d_spectral_inference on
  /// an input of `input_size` in `dtype`, made once and kept while the master weight is unchanged (the
  /// same rule as the blocked weights, and dropped with them). PrimaryCaps: 100 MB fp32, 50 MB bf16.
  torch::Tensor spectrum(const torch::nn::Conv2d& conv, torch::ScalarType dtype, std::array<int64_t, 2> input_size);

  /// How many times the spectrum was made (tests).
  int64_t spectra() const;

 private:
  mutable std::mutex mutex_;
  TensorStamp weight_stamp_;  // the master weight's storage and version the blocked weights were made from
  TensorStamp bias_stamp_;    // the same for the bias (cleared when there is none)
  torch::ScalarType dtype_ = torch::kFloat32;
  torch::Tensor weight_, bias_;  // blocked weight [O, C, K, K] and blocked bias [O] (or undefined)
  int64_t reorders_ = 0;
  // The kept spectrum ([2, F, C, O]) and what it was made from.
  TensorStamp spectrum_stamp_;
  torch::ScalarType spectrum_dtype_ = torch::kFloat32;
  std::array<int64_t, 2> spectrum_input_size_{0, 0};
  torch::Tensor spectrum_;
  int64_t spectra_ = 0;
};

}  // namespace capsnet::nn
