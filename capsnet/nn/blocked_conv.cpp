#include "capsnet/nn/blocked_conv.h"

#include "capsnet/nn/precision.h"
#include "capsnet/nn/spectral_conv.h"

#include <variant>

namespace capsnet::nn {
namespace {

std::vector<int64_t> pair_of(const torch::ExpandingArray<2>& a) { return {a->at(0), a->at(1)}; }


}  // namespace

BlockedConvWeights& BlockedConvWeights::operator=(const BlockedConvWeights&) {
  std::lock_guard<std::mutex> lock(mutex_);
  weight_stamp_.clear();
  bias_stamp_.clear();
  weight_ = bias_ = torch::Tensor();
  spectrum_stamp_.clear();
  spectrum_ = torch::Tensor();
  return *this;
}

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
  torch::Tensor weight, bias;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // The bias by storage and version, as the weight: a replaced bias tensor can carry the same version.
    const bool same_bias = b.defined() ? bias_.defined() && bias_stamp_.matches(b) : !bias_.defined();
    if (!weight_.defined() || !weight_stamp_.matches(w) || !same_bias || dtype_ != dtype) {
      // weight_: [O, C, K, K] in the blocked layout oneDNN's convolution reads for this geometry.
      weight_ = at::mkldnn_reorder_conv2d_weight(w.to(dtype).to_mkldnn(), padding, stride, dilation, o.groups());
      bias_ = b.defined() ? b.to(dtype).to_mkldnn() : torch::Tensor();
      weight_stamp_.record(w);
      if (b.defined()) bias_stamp_.record(b);
      else bias_stamp_.clear();
      dtype_ = dtype;
      ++reorders_;
    }
    weight = weight_;
    bias = bias_;
  }
  // x: [B, C, H, W], blocked in `dtype` (a previous blocked convolution's output, or converted here once).
  const auto xb = x.is_mkldnn() ? (x.scalar_type() == dtype ? x : x.to_dense().to(dtype).to_mkldnn())
                                : x.to(dtype).contiguous().to_mkldnn();
  return at::mkldnn_convolution(xb, weight, bias, padding, stride, dilation, o.groups());
}

torch::Tensor BlockedConvWeights::spectrum(const torch::nn::Conv2d& conv, torch::ScalarType dtype,
                                           std::array<int64_t, 2> input_size) {
  const auto& w = conv->weight;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!spectrum_.defined() || !spectrum_stamp_.matches(w) || spectrum_dtype_ != dtype ||
      spectrum_input_size_ != input_size) {
    spectrum_ = torch::Tensor();  // the old one goes before the new one is made
    const torch::NoGradGuard no_grad;
    spectrum_ = conv2d_spectral_weight_spectrum(
        w, input_size, {conv->options.stride()->at(0), conv->options.stride()->at(1)}, dtype);
    spectrum_stamp_.record(w);
    spectrum_dtype_ = dtype;
    spectrum_input_size_ = input_size;
    ++spectra_;
  }
  return spectrum_;
}

int64_t BlockedConvWeights::spectra() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spectra_;
}

int64_t BlockedConvWeights::reorders() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reorders_;
}

}  // namespace capsnet::nn
