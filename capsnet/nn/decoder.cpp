#include "capsnet/nn/decoder.h"

#include "capsnet/kernels/conv_dispatch.h"

namespace capsnet::nn {

DecoderImpl::DecoderImpl(const DecoderOptions& options_) : options(options_) { reset(); }

void DecoderImpl::reset() {
  fc1 = register_module("fc1", torch::nn::Linear(options.in_features(), options.hidden1()));
  fc2 = register_module("fc2", torch::nn::Linear(options.hidden1(), options.hidden2()));
  fc3 = register_module("fc3", torch::nn::Linear(options.hidden2(), options.out_features()));
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& masked, Precision precision) {
  auto h = torch::relu(kernels::linear_at(fc1, masked, precision, cast1_));  // [B, hidden1]
  h = torch::relu(kernels::linear_at(fc2, h, precision, cast2_));            // [B, hidden2]
  auto logits = kernels::linear_at(fc3, h, precision, cast3_);               // [B, out]
  if (precision != Precision::kFloat32) logits = logits.to(fc3->weight.scalar_type());
  return torch::sigmoid(logits);  // in the master dtype (fp32, or fp64 in gradchecks)
}

}  // namespace capsnet::nn
