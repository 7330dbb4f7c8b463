#pragma once
// The convolution dispatcher: which kernel runs a layer's convolution (or linear product) at a given
// precision and geometry -- the spectral form (spectral_conv.h), stride phases and the batch-swapped
// weight gradient (batch_swapped_conv.h), oneDNN's blocked tensors (blocked_conv.h), or ATen's -- and
// the predicates that decide it. Layers call conv2d_at / linear_at; the tests call each kernel directly.

#include <torch/torch.h>

#include <string>

#include "capsnet/kernels/blocked_conv.h"
#include "capsnet/kernels/precision.h"

namespace capsnet::kernels {

/// Input channels from which conv2d_at's bf16 convolutions compute their weight gradient batch-swapped
/// (kernels/batch_swapped_conv.h): PrimaryCaps (256) does, Conv1 (1) does not.
constexpr int64_t kBatchSwappedMinInChannels = 32;
/// Largest output area P x Q for the batch-swapped weight gradient: the swapped convolution's kernel is
/// the output gradient, and oneDNN's forward kernels are slow with large kernels. Measured in bf16 at
/// batch 100 (docs/kernels.md): PrimaryCaps' 6 x 6 output ~2x faster than oneDNN's weight gradient,
/// the baseline CNN's 10 x 10 and 20 x 20 (5 x 5 kernels, stride 1) 1.9x and 2.6x slower.
constexpr int64_t kBatchSwappedMaxOutputArea = 64;

/// A convolution's numeric zero padding, per spatial dim. Throws c10::Error naming `who` for "same" /
/// "valid" padding or a padding mode other than zeros (the paths that take raw geometry support
/// neither). The options hold a c10::variant in LibTorch 1.13 and a std::variant in 2.x; this is
/// the one place that tells them apart.
torch::ExpandingArray<2> numeric_padding(const torch::nn::detail::ConvNdOptions<2>& options, const char* who);

/// Whether conv2d_at's bf16 path computes the weight gradient of `conv` on an input of spatial size
/// in_h x in_w batch-swapped (groups 1, enough input channels, a small output).
bool use_batch_swapped_weight_grad(const torch::nn::detail::ConvNdOptions<2>& options, int64_t in_h, int64_t in_w);

/// Whether conv2d_at computes the input gradient of `conv` by stride phases (kernels/batch_swapped_conv.h), in
/// either precision: the batch-swapped geometry (above) with a stride above 1 and dilation 1 (PrimaryCaps;
/// measured 1.55x (bf16) / 1.3x (fp32) faster than oneDNN's backward-data kernel there, docs/kernels.md).
bool use_phase_input_grad(const torch::nn::detail::ConvNdOptions<2>& options, int64_t in_h, int64_t in_w);

/// Whether conv2d_at runs `conv` on an in_h x in_w input through DFTs (kernels/spectral_conv.h), in either
/// precision: groups 1, at least kBatchSwappedMinInChannels input channels, zero padding, dilation 1 and a
/// kernel large enough for spectral_conv_pays_off, whatever the output's size (PrimaryCaps at 28 x 28: 5.1x
/// fewer multiply-adds, measured ~2x faster per pass than oneDNN's fp32 kernels at batch 100 and in bf16
/// forward + backward 1.4-1.5x faster than oneDNN's bf16 kernels; at 40 x 40, 12 x 12 outputs: 7.8x fewer,
/// bf16 forward + backward 4x faster; docs/kernels.md).
bool use_spectral_conv(const torch::nn::detail::ConvNdOptions<2>& options, int64_t in_h, int64_t in_w);

/// Largest reduction depth C k0 k1 per output at which conv2d_at trains a convolution as one product per
/// image over its patches (kernels/unfolded_conv.h): Conv1 (1 x 9 x 9 = 81).
constexpr int64_t kUnfoldedMaxDepth = 81;

/// Whether conv2d_at runs `conv` through conv2d_unfolded under autograd in bf16: groups 1, dilation 1, numeric
/// zero padding and a reduction depth of at most kUnfoldedMaxDepth (docs/kernels.md, "Conv1 as one product
/// per image", has the measurements).
bool use_unfolded_conv(const torch::nn::detail::ConvNdOptions<2>& options);

/// Inference (autograd off) takes the spectral form from this batch size on: it makes the weight's
/// spectrum on every call (~15 ms fp32, ~11 ms bf16 for PrimaryCaps), which the blocked direct kernel
/// (weights reordered once) beats below it. Measured, PrimaryCaps forward: fp32 batch 16 23.7 vs 17.5 ms
/// direct, 32 29.3 vs 36.7, 100 53.4 vs 120.7; bf16 16 14.7 vs 8.9, 32 18.2 vs 18.2, 100 31.8 vs 56.2
/// (docs/kernels.md).
constexpr int64_t kSpectralInferenceMinBatch = 32;

/// conv(x) with input, weight and bias in the compute dtype (the output stays in it). Autograd
/// returns fp32 gradients to the fp32 weights through the casts. Where use_spectral_conv says so, all
/// three passes run through DFTs (with autograd off, from kSpectralInferenceMinBatch examples on): in
/// fp32 in the master dtype (float32 or float64), in bf16 with a bf16 input and the fp32 master weight.
/// Otherwise, in bf16, where use_batch_swapped_weight_grad says so, the weight gradient is computed
/// batch-swapped; in either precision, where use_phase_input_grad says so, the input gradient by stride
/// phases.
/// Otherwise, with `blocked` and autograd off (BlockedConvWeights::usable), it runs on oneDNN's blocked tensors
/// with weights reordered once, and returns a blocked tensor (is_mkldnn()): the caller calls
/// to_dense() where it leaves its convolution stack. A blocked x is accepted either way.
/// relu_input: convolve relu(x) instead (Conv1 -> ReLU -> PrimaryCaps); in the spectral form under autograd
/// the ReLU is fused into it (conv2d_spectral_relu: its backward keeps one bit per element of x, not relu(x)).
/// x is taken by value: a caller that moves it in lets the spectral inference drop it (or a blocked x once
/// its dense copy is made) before the products (PrimaryCaps' input at batch 100: 41 MB fp32 each).
torch::Tensor conv2d_at(torch::nn::Conv2d& conv, torch::Tensor x, Precision precision,
                        BlockedConvWeights* blocked = nullptr, bool relu_input = false);
/// Makes ahead what conv2d_at(conv, x, precision, blocked) keeps in `blocked` for an x of x_sizes [N, C, H, W]
/// without autograd (the spectral form's weight spectrum; nothing where conv2d_at keeps nothing), so that a
/// caller can make it before x exists. x's dtype: the master weight's in fp32, bf16 in bf16.
void prepare_conv2d_at(torch::nn::Conv2d& conv, torch::IntArrayRef x_sizes, Precision precision,
                       BlockedConvWeights* blocked);
/// linear(x) likewise.
torch::Tensor linear_at(torch::nn::Linear& linear, const torch::Tensor& x, Precision precision);

/// conv_transpose2d(x, weight, bias) (dilation 1) with its GEMM in `precision`, returned in weight's dtype.
/// x: [B, C_in, H, W]; weight: [C_in, C_out / groups, k0, k1]; bias: [C_out] or undefined
///   -> [B, C_out, H', W'], H' = (H - 1) s - 2p + k0 + output_padding.
/// fp32: ATen's transposed convolution. bf16: weight^T x as a bf16 matrix product on copies cast per call
/// (fp32 gradients reach the fp32 weights through the casts), then the overlap-add of the patches (col2im,
/// a sum) and the bias in the master dtype. Why not ATen's in bf16: LibTorch 1.13's oneDNN bf16
/// transposed convolution refuses these shapes (its shape check reads the weight as a forward one's).
torch::Tensor conv_transpose2d_at(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  torch::ExpandingArray<2> stride, torch::ExpandingArray<2> padding,
                                  torch::ExpandingArray<2> output_padding, int64_t groups, Precision precision);

}  // namespace capsnet::kernels
