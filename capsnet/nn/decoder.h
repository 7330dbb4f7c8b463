#pragma once
#include <torch/torch.h>

#include "capsnet/kernels/cast_cache.h"
#include "capsnet/kernels/precision.h"

namespace capsnet::nn {

struct DecoderOptions {
  DecoderOptions(int64_t in_features, int64_t out_features) : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);   // J * D = 160
  TORCH_ARG(int64_t, out_features);  // 784
  TORCH_ARG(int64_t, hidden1) = 512;
  TORCH_ARG(int64_t, hidden2) = 1024;
};

/// Reconstruction decoder: FC hidden1 ReLU -> FC hidden2 ReLU -> FC out sigmoid.
/// masked capsules [B, J * D] -> pixel intensities [B, out_features] in (0, 1).
class DecoderImpl : public torch::nn::Cloneable<DecoderImpl> {
 public:
  explicit DecoderImpl(const DecoderOptions& options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& masked, Precision precision = Precision::kFloat32);

  DecoderOptions options;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};

 private:
  // The three layers' bf16 weights, kept between inference calls (kernels/cast_cache.h).
  kernels::LinearCastCache cast1_, cast2_, cast3_;
};
TORCH_MODULE(Decoder);

}  // namespace capsnet::nn
