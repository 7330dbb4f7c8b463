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
// from kSpectralInferenceMinBatch on), its weight spectrum instead (100 MB fp32, 75 MB bf16 with Wr - Wi).

#include <torch/torch.h>

#include <array>

#include "capsnet/kernels/weight_cache.h"

namespace capsnet::kernels {

/// One convolution's weights in oneDNN's blocked layout, and the inference forward that uses them.
/// Owned by the module whose convolution it serves; safe to call from several threads; a copy (of a cloned
/// module) starts empty. Both forms are kept by the rule of weight_cache.h.
class BlockedConvWeights {
 public:
  /// True when conv(x) may run blocked: autograd is not recording, x is a CPU tensor (dense or
  /// blocked) in fp32 or `dtype`, the weights are fp32, dtype is fp32 or bf16, and conv has groups 1
  /// and numeric zero padding. A float64 model always takes the plain path.
  static bool usable(const torch::nn::Conv2d& conv, const torch::Tensor& x, torch::ScalarType dtype);

  /// y = conv(x) in `dtype` with the cached blocked weights. x: [B, C, H, W], dense (any float dtype)
  /// or blocked in `dtype`. Returns y: [B, O, H', W'] as a blocked (is_mkldnn) tensor in `dtype`.
  torch::Tensor forward(const torch::nn::Conv2d& conv, const torch::Tensor& x, torch::ScalarType dtype);

  /// How many times the weights were reordered (tests: once per weight update, not per call).
  int64_t reorders() const { return blocked_.made(); }

  /// The spectral form's counterpart (kernels/spectral_conv.h): w^T's spectrum for conv2d_spectral_inference on
  /// an input of `input_size` in `dtype`, made once and kept while the master weight is unchanged (the
  /// same rule as the blocked weights, and dropped with them). PrimaryCaps: 100 MB fp32, 75 MB bf16 (three parts).
  torch::Tensor spectrum(const torch::nn::Conv2d& conv, torch::ScalarType dtype, std::array<int64_t, 2> input_size);

  /// How many times the spectrum was made (tests).
  int64_t spectra() const { return spectrum_.made(); }

 private:
  WeightCache blocked_;   // {weight [O, C, K, K] blocked, bias [O] blocked or undefined}, form {dtype}
  WeightCache spectrum_;  // {w^T's spectrum [2, F, C, O]}, form {dtype, H, W}
};

}  // namespace capsnet::kernels
