#pragma once
// Weights cast to the compute precision once for inference.
//
// Under --precision bf16 a linear layer casts its fp32 master weights to bf16 on every call: at batch 1
// that cast is most of the decoder's time (1.4 M weights read and written per forward; measured in
// docs/kernels.md). Without autograd nothing needs the cast to be part of a graph, so the bf16 copy is
// kept until the master changes (its storage or version counter: an Adam step, a load) or a forward
// runs under autograd (training: LibTorch 1.13's SGD updates p.data(), which bumps no version counter),
// by the rule of weight_cache.h. Under autograd every call casts afresh, so that the
// gradient reaches the fp32 master. The cached copy is the same cast, so outputs are bit-identical.

#include <torch/torch.h>

#include "capsnet/kernels/precision.h"
#include "capsnet/kernels/weight_cache.h"

namespace capsnet::kernels {

/// One tensor's cast to a compute dtype, kept between inference calls. Safe to call from several threads.
class CastCache {
 public:
  /// t.to(dtype): the kept copy when autograd is not recording and t has not changed since it was made,
  /// else a fresh cast (kept for the next call when autograd is not recording; a call under autograd
  /// drops the kept copy). An undefined t gives an undefined tensor.
  torch::Tensor get(const torch::Tensor& t, torch::ScalarType dtype);

  /// How many casts were kept (tests: once per weight update, not per call).
  int64_t casts() const { return cache_.made(); }

 private:
  WeightCache cache_;  // {t.to(dtype)}, form {dtype}; a copy starts empty
};

/// A linear layer's weight and bias casts.
struct LinearCastCache {
  CastCache weight, bias;
};

/// linear_at (precision.h) with the compute-precision weights taken from `cache` when autograd is not
/// recording. Same values as linear_at(linear, x, precision).
torch::Tensor linear_at(torch::nn::Linear& linear, const torch::Tensor& x, Precision precision,
                        LinearCastCache& cache);

}  // namespace capsnet::kernels
