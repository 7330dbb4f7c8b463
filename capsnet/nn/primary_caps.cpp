#include "capsnet/nn/primary_caps.h"

#include <cmath>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/nn/functional.h"

namespace capsnet::nn {

PrimaryCapsImpl::PrimaryCapsImpl(const PrimaryCapsOptions& options_) : options(options_) { reset(); }

void PrimaryCapsImpl::reset() {
  TORCH_CHECK(options.in_channels() > 0 && options.capsule_types() > 0 && options.capsule_dim() > 0 &&
                  options.kernel_size() > 0 && options.stride() > 0 && options.output_scale() > 0 &&
                  std::isfinite(options.output_scale()),
              "PrimaryCaps: all options must be positive (output_scale finite)");
  conv = register_module(
      "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(options.in_channels(),
                                                         options.capsule_types() * options.capsule_dim(),
                                                         options.kernel_size())
                                    .stride(options.stride())));
}

void PrimaryCapsImpl::prepare(torch::IntArrayRef x_sizes, Precision precision) {
  kernels::prepare_conv2d_at(conv, x_sizes, precision, &blocked_conv);
}

torch::Tensor PrimaryCapsImpl::forward(torch::Tensor x, Precision precision, bool relu_input) {
  // The convolution may run in bf16; the capsules (and squash's norm) are fp32.
  auto y = kernels::conv2d_at(conv, std::move(x), precision, &blocked_conv, relu_input);  // [B, types * dim, H', W']
  if (y.is_mkldnn()) y = y.to_dense();                    // the capsules leave oneDNN's layout here
  if (precision != Precision::kFloat32) y = y.to(conv->weight.scalar_type());  // back to the master dtype
  if (options.output_scale() != 1.0) y = y * options.output_scale();
  const auto B = y.size(0), H = y.size(2), W = y.size(3);
  // Channel k = type * dim + atom. Atoms must be moved last before flattening: a plain
  // view to [B, -1, dim] would mix atoms of neighbouring positions into one capsule.
  auto u = y.view({B, options.capsule_types(), options.capsule_dim(), H, W})
               .permute({0, 1, 3, 4, 2})                       // [B, types, H', W', dim]
               .reshape({B, options.capsule_types() * H * W, options.capsule_dim()});
  return squash(u);
}

}  // namespace capsnet::nn
