#include "capsnet/nn/decoder.h"

namespace capsnet::nn {

DecoderImpl::DecoderImpl(const DecoderOptions& options_) : options(options_) { reset(); }

void DecoderImpl::reset() {
  fc1 = register_module("fc1", torch::nn::Linear(options.in_features(), options.hidden1()));
  fc2 = register_module("fc2", torch::nn::Linear(options.hidden1(), options.hidden2()));
  fc3 = register_module("fc3", torch::nn::Linear(options.hidden2(), options.out_features()));
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& masked) {
  return torch::sigmoid(fc3(torch::relu(fc2(torch::relu(fc1(masked))))));
}

}  // namespace capsnet::nn
