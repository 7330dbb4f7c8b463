#include "capsnet/kernels/blocked_conv.h"

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/kernels/spectral_conv.h"

#include <variant>

namespace capsnet::kernels {
namespace {

std::vector<int64_t> pair_of(const torch::ExpandingArray<2>& a) { return {a->at(0), a->at(1)}; }


}  // namespace

bool BlockedConvWeights::usable(const torch::nn::Conv2d& conv, const torch::Tensor& x, torch::ScalarType dtype) {
  const auto& o = conv->options;
  return !torch::GradMode::is_enabled() && at::hasMKLDNN() && at::globalContext().userEnabledMkldnn() &&
         x.device().is_cpu() && (x.is_mkldnn() || x.layout() == torch::kStrided) &&
         (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && conv->weight.device().is_cpu() &&
         // fp32 masters and fp32 (or already compute-dtype) inputs only: a float64 model (gradchecks,
         // finite differences under NoGradGuard) must not be rounded to fp32 here.
         conv->weight.scalar_type() == torch::kFloat32 &&
         (x.is_mkldnn() || x.scalar_type() == torch::kFloat32 || x.scalar_type() == dtype) &&
         o.groups() == 1 && o.padding().index() == 0 && o.padding_mode().index() == 0;
}

torch::Tensor BlockedConvWeights::forward(const torch::nn::Conv2d& conv, const torch::Tensor& x,
                                          torch::ScalarType dtype) {
  TORCH_CHECK(usable(conv, x, dtype), "BlockedConvWeights: this convolution cannot run blocked here");
  const auto& o = conv->options;
  const auto padding = pair_of(numeric_padding(o, "BlockedConvWeights"));
  const auto stride = pair_of(o.stride()), dilation = pair_of(o.dilation());
  const auto& w = conv->weight;
  const auto& b = conv->bias;
  // The bias by storage and version, as the weight: a replaced bias tensor can carry the same version.
  const auto kept = blocked_.get({w, b}, {static_cast<int64_t>(dtype)}, [&] {
    // [O, C, K, K] in the blocked layout oneDNN's convolution reads for this geometry; [O] or undefined.
    return std::vector<torch::Tensor>{
        at::mkldnn_reorder_conv2d_weight(w.to(dtype).to_mkldnn(), padding, stride, dilation, o.groups()),
        b.defined() ? b.to(dtype).to_mkldnn() : torch::Tensor()};
  });
  const auto &weight = kept[0], &bias = kept[1];
  // x: [B, C, H, W], blocked in `dtype` (a previous blocked convolution's output, or converted here once).
  const auto xb = x.is_mkldnn() ? (x.scalar_type() == dtype ? x : x.to_dense().to(dtype).to_mkldnn())
                                : x.to(dtype).contiguous().to_mkldnn();
  return at::mkldnn_convolution(xb, weight, bias, padding, stride, dilation, o.groups());
}

torch::Tensor BlockedConvWeights::spectrum(const torch::nn::Conv2d& conv, torch::ScalarType dtype,
                                           std::array<int64_t, 2> input_size) {
  const auto& w = conv->weight;
  return spectrum_.get({w}, {static_cast<int64_t>(dtype), input_size[0], input_size[1]}, [&] {
    const torch::NoGradGuard no_grad;
    return std::vector<torch::Tensor>{conv2d_spectral_weight_spectrum(
        w, input_size, {conv->options.stride()->at(0), conv->options.stride()->at(1)}, dtype)};
  })[0];
}

}  // namespace capsnet::kernels
