#include "capsnet/kernels/conv_dispatch.h"

#include <variant>

#include "capsnet/kernels/batch_swapped_conv.h"
#include "capsnet/kernels/linear.h"
#include "capsnet/kernels/spectral_conv.h"
#include "capsnet/kernels/unfolded_conv.h"

namespace capsnet::kernels {

torch::ExpandingArray<2> numeric_padding(const torch::nn::detail::ConvNdOptions<2>& o, const char* who) {
  TORCH_CHECK(o.padding().index() == 0 && o.padding_mode().index() == 0, who,
              ": only numeric zero padding is supported");
  using std::get;  // found by ADL for c10::variant too
  return get<0>(o.padding());
}

bool use_batch_swapped_weight_grad(const torch::nn::detail::ConvNdOptions<2>& o, int64_t in_h, int64_t in_w) {
  if (o.groups() != 1 || o.in_channels() < kBatchSwappedMinInChannels || o.padding().index() != 0 ||
      o.padding_mode().index() != 0)
    return false;
  const auto padding = numeric_padding(o, "use_batch_swapped_weight_grad");
  auto out = [&](int64_t in, int d) {
    return (in + 2 * padding->at(d) - o.dilation()->at(d) * (o.kernel_size()->at(d) - 1) - 1) / o.stride()->at(d) + 1;
  };
  return out(in_h, 0) * out(in_w, 1) <= kBatchSwappedMaxOutputArea;
}

bool use_phase_input_grad(const torch::nn::detail::ConvNdOptions<2>& o, int64_t in_h, int64_t in_w) {
  const auto& stride = o.stride();
  const auto& dilation = o.dilation();
  return use_batch_swapped_weight_grad(o, in_h, in_w) && (stride->at(0) > 1 || stride->at(1) > 1) &&
         dilation->at(0) == 1 && dilation->at(1) == 1;
}

bool use_spectral_conv(const torch::nn::detail::ConvNdOptions<2>& o, int64_t in_h, int64_t in_w) {
  // Not tied to the batch-swapped geometry's small outputs: the DFTs' saving grows with the output.
  if (o.groups() != 1 || o.in_channels() < kBatchSwappedMinInChannels || o.padding().index() != 0 ||
      o.padding_mode().index() != 0)
    return false;
  const auto padding = numeric_padding(o, "use_spectral_conv");
  const auto& k = o.kernel_size();
  const auto& s = o.stride();
  if (padding->at(0) != 0 || padding->at(1) != 0 || o.dilation()->at(0) != 1 || o.dilation()->at(1) != 1 ||
      in_h < k->at(0) || in_w < k->at(1))
    return false;
  return spectral_conv_pays_off({k->at(0), k->at(1)},
                                {(in_h - k->at(0)) / s->at(0) + 1, (in_w - k->at(1)) / s->at(1) + 1},
                                {s->at(0), s->at(1)});
}

bool use_unfolded_conv(const torch::nn::detail::ConvNdOptions<2>& o) {
  if (o.groups() != 1 || o.padding().index() != 0 || o.padding_mode().index() != 0 || o.dilation()->at(0) != 1 ||
      o.dilation()->at(1) != 1)
    return false;
  return o.in_channels() * o.kernel_size()->at(0) * o.kernel_size()->at(1) <= kUnfoldedMaxDepth;
}

namespace {
// Whether conv2d_at runs conv on a CPU input of x_sizes through DFTs (5x fewer multiply-adds for
// PrimaryCaps-like convolutions; in bf16 with spectra and products in bf16 and fp32 sums: docs/kernels.md,
// "Spectral convolution for PrimaryCaps").
bool spectral_at(const torch::nn::Conv2d& conv, torch::IntArrayRef x_sizes, Precision precision) {
  return x_sizes.size() == 4 && (precision == Precision::kFloat32 || conv->weight.scalar_type() == torch::kFloat) &&
         use_spectral_conv(conv->options, x_sizes[2], x_sizes[3]) &&
         (torch::GradMode::is_enabled() || x_sizes[0] >= kSpectralInferenceMinBatch);
}
}  // namespace

void prepare_conv2d_at(torch::nn::Conv2d& conv, torch::IntArrayRef x_sizes, Precision precision,
                       BlockedConvWeights* blocked) {
  if (!blocked || torch::GradMode::is_enabled() || !conv->weight.device().is_cpu() ||
      !spectral_at(conv, x_sizes, precision))
    return;
  const auto dtype = precision == Precision::kFloat32 ? conv->weight.scalar_type() : compute_dtype(precision);
  blocked->spectrum(conv, dtype, {x_sizes[2], x_sizes[3]});
}

torch::Tensor conv2d_at(torch::nn::Conv2d& conv, torch::Tensor x, Precision precision, BlockedConvWeights* blocked,
                        bool relu_input) {
  const auto dtype = compute_dtype(precision);
  const auto& o = conv->options;
  const bool spectral = x.device().is_cpu() && spectral_at(conv, x.sizes(), precision);
  // The ReLU is fused into the spectral form: into its backward under autograd (conv2d_spectral_relu), into the
  // input's last-axis stage at inference with a kept spectrum (conv2d_spectral_inference); elsewhere it runs first.
  const bool spectral_inference = spectral && blocked && !torch::GradMode::is_enabled();
  const bool fused_relu = relu_input && spectral && (torch::GradMode::is_enabled() || spectral_inference);
  const bool separate_relu = relu_input && !fused_relu;
  // Little reduction depth per output (Conv1) at inference from kSpectralInferenceMinBatch images on, in either
  // precision: one product per image over the patches, to a dense output (what the spectral PrimaryCaps and
  // the CNN's pooling read). Measured against the blocked kernel + to_dense() and ATen's dense call, batch 100:
  // Conv1 bf16 4.1 vs 6.7 / 6.5 ms, fp32 6.7 vs 8.1 / 7.9; at 40 x 40 bf16 6.3 vs 15.4, the CNN's conv1 bf16
  // 4.8 vs 12.6 (docs/kernels.md). Below that batch the blocked kernel feeds a blocked consumer.
  if (!torch::GradMode::is_enabled() && x.dim() == 4 && !x.is_mkldnn() && x.device().is_cpu() &&
      x.size(0) >= kSpectralInferenceMinBatch && use_unfolded_conv(o)) {
    const auto padding = numeric_padding(o, "conv2d_at");
    const auto xc = precision == Precision::kFloat32 ? x : x.to(dtype);
    return conv2d_unfolded(separate_relu ? torch::relu(xc) : xc, conv->weight, conv->bias,
                           {o.stride()->at(0), o.stride()->at(1)}, {padding->at(0), padding->at(1)});
  }
  if (!spectral && blocked && BlockedConvWeights::usable(conv, x, dtype))
    return blocked->forward(conv, separate_relu ? torch::relu(x) : x, dtype);
  // A forward under autograd is training: the optimizer step after it may change the weights without
  // bumping their version counter (LibTorch 1.13's SGD updates p.data()), so the kept blocked weights
  // are dropped here and the next inference call reorders afresh (as it must after any step anyway).
  if (blocked && torch::GradMode::is_enabled()) *blocked = BlockedConvWeights();
  // A blocked input (inference after a blocked Conv1) is made dense here, a copy of our own (the blocked one
  // goes with the assignment): its ReLU runs in place on that copy rather than as a third copy of x
  // (PrimaryCaps' input: 51 MB bf16 at batch 250).
  const bool was_blocked = x.is_mkldnn();
  if (was_blocked) x = x.to_dense();
  if (separate_relu) x = was_blocked ? x.relu_() : torch::relu(x);
  // bf16: x in bf16, the fp32 weight and bias as they are (their gradients come back in fp32).
  if (spectral) {
    if (precision != Precision::kFloat32) x = x.to(dtype);
    const std::array<int64_t, 2> stride{o.stride()->at(0), o.stride()->at(1)};
    // Inference with a cache to keep it in: the weight's spectrum is made once per weight update; x is
    // handed over (the inference lets it go once its last-axis stage is made).
    if (spectral_inference) {
      const auto w_spectrum = blocked->spectrum(conv, x.scalar_type(), {x.size(2), x.size(3)});
      return conv2d_spectral_inference(std::move(x), w_spectrum, conv->bias,
                                       {o.kernel_size()->at(0), o.kernel_size()->at(1)}, stride,
                                       kSpectralChunkBytes, relu_input);
    }
    return fused_relu ? conv2d_spectral_relu(x, conv->weight, conv->bias, stride)
                      : conv2d_spectral(x, conv->weight, conv->bias, stride);
  }
  // Little reduction depth per output (Conv1), training in bf16: one product per image over the patches
  // (in fp32 oneDNN's direct kernel is as fast at 28 x 28 and faster at 40 x 40: it stays).
  if (precision != Precision::kFloat32 && x.dim() == 4 && torch::GradMode::is_enabled() && use_unfolded_conv(o)) {
    const auto padding = numeric_padding(o, "conv2d_at");
    return conv2d_unfolded(x.to(dtype), conv->weight, conv->bias, {o.stride()->at(0), o.stride()->at(1)},
                           {padding->at(0), padding->at(1)});
  }
  // Many input channels and a small output: oneDNN's bf16 weight gradient is ~2x slower than the same
  // FLOPs as a forward convolution, and its backward-data kernel for a strided one 1.55x (bf16) / 1.3x
  // (fp32) slower than forward convolutions by stride phase (measured, docs/kernels.md), so those
  // gradients run as forward convolutions. With few
  // input channels (Conv1: 1) or a large output (the CNN's 20 x 20) the swapped forms are slower and
  // oneDNN's stay; in fp32 oneDNN's weight gradient is as fast as the swapped one.
  const bool swapped_weight = precision != Precision::kFloat32 && use_batch_swapped_weight_grad(o, x.size(-2), x.size(-1));
  const bool phase_input = x.dim() == 4 && use_phase_input_grad(o, x.size(-2), x.size(-1));
  if (precision == Precision::kFloat32 && !phase_input) return conv->forward(x);
  const auto padding = numeric_padding(o, "conv2d_at");
  // fp32 keeps the master dtype (float64 models, gradchecks); bf16 casts input, weight and bias.
  const auto cast = [&](const torch::Tensor& t) {
    return precision == Precision::kFloat32 || !t.defined() ? t : t.to(dtype);
  };
  const auto xc = cast(x), w = cast(conv->weight), b = cast(conv->bias);
  if (swapped_weight || phase_input) {
    const Conv2dGeometry geometry{{o.stride()->at(0), o.stride()->at(1)}, {padding->at(0), padding->at(1)},
                                  {o.dilation()->at(0), o.dilation()->at(1)}};
    return conv2d_with_gradient_paths(xc, w, b, geometry, {swapped_weight, phase_input});
  }
  return torch::conv2d(xc, w, b, o.stride(), padding, o.dilation(), o.groups());
}

torch::Tensor linear_at(torch::nn::Linear& linear, const torch::Tensor& x, Precision precision) {
  if (precision == Precision::kFloat32) {
    // float32 2-D inputs on oneDNN's sgemm (linear.h: 3-10x faster than ATen's OpenBLAS here).
    if (x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() &&
        linear->weight.scalar_type() == torch::kFloat && linear->weight.device().is_cpu())
      return linear_gemm(x, linear->weight, linear->bias);
    return linear->forward(x);
  }
  const auto dtype = compute_dtype(precision);
  return torch::linear(x.to(dtype), linear->weight.to(dtype),
                       linear->bias.defined() ? linear->bias.to(dtype) : linear->bias);
}

torch::Tensor conv_transpose2d_at(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  torch::ExpandingArray<2> stride, torch::ExpandingArray<2> padding,
                                  torch::ExpandingArray<2> output_padding, int64_t groups, Precision precision) {
  if (precision == Precision::kFloat32)
    return torch::conv_transpose2d(x, weight, bias, stride, padding, output_padding, groups, /*dilation=*/1);
  namespace F = torch::nn::functional;
  TORCH_CHECK(x.dim() == 4 && weight.dim() == 4 && groups > 0 && x.size(1) == weight.size(0) &&
                  weight.size(0) % groups == 0,
              "conv_transpose2d_at: x ", x.sizes(), " and weight ", weight.sizes(), " do not match (groups ", groups, ")");
  const int64_t B = x.size(0), H = x.size(2), W = x.size(3), G = groups, I = x.size(1) / G;
  const int64_t C = weight.size(1), k0 = weight.size(2), k1 = weight.size(3);
  const int64_t Ho = (H - 1) * stride->at(0) - 2 * padding->at(0) + k0 + output_padding->at(0);
  const int64_t Wo = (W - 1) * stride->at(1) - 2 * padding->at(1) + k1 + output_padding->at(1);
  // cols[g, (c, ky, kx), (b, y, x)] = sum_i weight[g I + i, c, ky, kx] x[b, g I + i, y, x]: the GEMM, in
  // bf16. The batch is in its columns so that the weight gradient is one product over every example and
  // position (rounded once), not a bf16 sum of per-example products.
  const auto dtype = compute_dtype(precision);
  const int64_t M = C * k0 * k1, N = B * H * W;
  auto w = weight.to(dtype).reshape({G, I, M}).transpose(1, 2);                                 // [G, M, I]
  auto xs = x.to(dtype).reshape({B, G, I, H * W}).permute({1, 2, 0, 3}).reshape({G, I, N});  // [G, I, B H W]
  auto cols = torch::bmm(w, xs).view({G, M, B, H * W}).permute({2, 0, 1, 3}).reshape({B, G * M, H * W});
  // Overlap-add of every input pixel's k0 x k1 patch at stride s, cropped by the padding (col2im): sums,
  // so in the master dtype. Every output side gives exactly H x W patch positions (output_padding < s).
  auto y = F::fold(cols.to(weight.scalar_type()),
                   F::FoldFuncOptions({Ho, Wo}, {k0, k1}).stride(stride).padding(padding));  // [B, G C, Ho, Wo]
  if (bias.defined()) y = y + bias.view({1, -1, 1, 1});
  return y;
}

}  // namespace capsnet::kernels
