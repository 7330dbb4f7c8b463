// kernels/batch_swapped_conv.h: the weight gradient as a forward convolution over the swapped batch, and the
// input gradient as one forward convolution per stride phase, equal ATen's convolution_backward (float64,
// every geometry the formulas cover), the autograd function passes a finite-difference gradcheck with
// either path, and the convolutions of kernels::conv2d_at really take them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "capsnet/kernels/batch_swapped_conv.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "gradcheck.h"
#include "precisions.h"

namespace capsnet {
namespace {

using kernels::Conv2dGeometry;

struct Case {
  int64_t n, c, o, h, w, k0, k1;
  Conv2dGeometry geometry;
};

std::vector<Case> cases() {
  return {
      {2, 3, 4, 11, 9, 3, 3, {{1, 1}, {0, 0}, {1, 1}}},
      {3, 5, 2, 20, 20, 9, 9, {{2, 2}, {0, 0}, {1, 1}}},      // PrimaryCaps' geometry
      {2, 4, 3, 13, 10, 3, 2, {{2, 1}, {1, 2}, {2, 1}}},      // every axis different
      {1, 2, 2, 8, 8, 1, 1, {{3, 3}, {0, 0}, {1, 1}}},        // 1x1 kernel, stride beyond it
      {2, 3, 5, 10, 12, 4, 3, {{1, 2}, {2, 0}, {1, 3}}},
  };
}

torch::Tensor conv_output(const torch::Tensor& x, const torch::Tensor& w, const Conv2dGeometry& g) {
  return at::conv2d(x, w, {}, {g.stride[0], g.stride[1]}, {g.padding[0], g.padding[1]},
                    {g.dilation[0], g.dilation[1]});
}

/// A case's convolution with random float64 x [n, c, h, w], w [o, c, k0, k1] and output gradient dy.
struct Problem {
  torch::Tensor x, w, dy;
};
Problem random_problem(const Case& t, int64_t c) {
  auto x = torch::randn({t.n, c, t.h, t.w}, torch::kDouble);
  auto w = torch::randn({t.o, c, t.k0, t.k1}, torch::kDouble);
  auto dy = torch::randn_like(conv_output(x, w, t.geometry));
  return {x, w, dy};
}

TEST(BatchSwappedConv, WeightGradientEqualsAtenInFloat64) {
  torch::manual_seed(3);
  for (const auto& t : cases()) {
    const auto [x, w, dy] = random_problem(t, t.c);
    const auto fast = kernels::conv2d_weight_grad_batch_swapped(dy, x, {t.k0, t.k1}, t.geometry);
    const auto reference = kernels::conv2d_weight_grad_reference(dy, x, w, t.geometry);
    ASSERT_EQ(fast.sizes(), reference.sizes());
    EXPECT_LT((fast - reference).abs().max().item<double>(), 1e-10) << "case n=" << t.n << " c=" << t.c;
  }
}

TEST(BatchSwappedConv, ChunksOverInputChannelsGiveTheSameGradient) {
  // The input channels go through the swapped convolution in chunks of at most chunk_bytes of x's copy:
  // one channel per chunk, uneven chunks (7 channels as 3 + 3 + 1, or more per chunk where the copy is
  // cropped) and one chunk must agree with ATen.
  torch::manual_seed(5);
  for (const auto& t : cases()) {
    const auto [x, w, dy] = random_problem(t, 7);
    const auto reference = kernels::conv2d_weight_grad_reference(dy, x, w, t.geometry);
    const int64_t channel_bytes = t.n * t.h * t.w * 8;  // an upper bound: the copy is cropped to the window
    for (const int64_t chunk_bytes : {int64_t{1}, 3 * channel_bytes, int64_t{1} << 30}) {
      const auto fast = kernels::conv2d_weight_grad_batch_swapped(dy, x, {t.k0, t.k1}, t.geometry, chunk_bytes);
      ASSERT_EQ(fast.sizes(), reference.sizes());
      EXPECT_LT((fast - reference).abs().max().item<double>(), 1e-10)
          << "case n=" << t.n << " chunk_bytes=" << chunk_bytes;
    }
  }
  if (!cpu_has_native_bf16()) return;  // bf16 convolutions run on oneDNN's AVX512_BF16 / AMX kernels
  // The bf16 PrimaryCaps gradient in chunks (the default, 6 MB: 3 chunks of its 256 channels) is the
  // one-chunk gradient: each entry reduces over the same products.
  const auto x = torch::randn({100, 256, 20, 20}).to(torch::kBFloat16);
  const auto dy = torch::randn({100, 16, 6, 6}).to(torch::kBFloat16);
  const Conv2dGeometry primary{{2, 2}, {0, 0}, {1, 1}};
  const auto chunked = kernels::conv2d_weight_grad_batch_swapped(dy, x, {9, 9}, primary);
  const auto whole = kernels::conv2d_weight_grad_batch_swapped(dy, x, {9, 9}, primary, int64_t{1} << 40);
  EXPECT_LT((chunked.to(torch::kFloat) - whole.to(torch::kFloat)).abs().max().item<float>(),
            1e-2 * whole.to(torch::kFloat).abs().max().item<float>());
}

TEST(BatchSwappedConv, ForwardAndAllGradientsPassGradcheck) {
  torch::manual_seed(4);
  for (const auto& t : cases()) {
    auto x = torch::randn({t.n, t.c, t.h, t.w}, torch::kDouble).requires_grad_();
    auto w = torch::randn({t.o, t.c, t.k0, t.k1}, torch::kDouble).requires_grad_();
    auto b = torch::randn({t.o}, torch::kDouble).requires_grad_();
    const auto y = kernels::conv2d_batch_swapped(x, w, b, t.geometry);
    EXPECT_TRUE(torch::allclose(y, conv_output(x, w, t.geometry) + b.view({1, -1, 1, 1})));
    const auto fn = [&](const std::vector<torch::Tensor>& in) {
      return kernels::conv2d_batch_swapped(in[0], in[1], in[2], t.geometry);
    };
    EXPECT_TRUE(testing::gradcheck(fn, {x, w, b})) << "case n=" << t.n << " c=" << t.c;
  }
}

TEST(BatchSwappedConv, WithoutBiasOrInputGradient) {
  torch::manual_seed(5);
  const Conv2dGeometry g{{2, 2}, {0, 0}, {1, 1}};
  const auto x = torch::randn({2, 3, 9, 9}, torch::kDouble);  // an image batch: no gradient wanted
  auto w = torch::randn({4, 3, 3, 3}, torch::kDouble).requires_grad_();
  kernels::conv2d_batch_swapped(x, w, torch::Tensor(), g).sum().backward();
  const auto expected = kernels::conv2d_weight_grad_reference(torch::ones({2, 4, 4, 4}, torch::kDouble), x, w, g);
  EXPECT_LT((w.grad() - expected).abs().max().item<double>(), 1e-10);
}

TEST(BatchSwappedConv, RefusesMismatchedBatches) {
  const auto dy = torch::randn({2, 4, 3, 3});
  const auto x = torch::randn({3, 2, 5, 5});
  EXPECT_THROW(kernels::conv2d_weight_grad_batch_swapped(dy, x, {3, 3}, {}), c10::Error);
}

// A bf16 convolution with many input channels takes the swapped weight gradient (bit-identical to it)
// and stays within bf16 rounding of the fp32 gradient; Conv1-like convolutions keep oneDNN's.
TEST(BatchSwappedConv, Bf16ConvolutionsOfConv2dAtUseIt) {
  if (!cpu_has_native_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16 / AMX";
  torch::manual_seed(6);
  const int64_t channels = kernels::kBatchSwappedMinInChannels;
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(channels, 16, 5).stride(2));
  const auto x = torch::rand({4, channels, 15, 15});
  const auto dy = torch::randn({4, 16, 6, 6});

  auto y = kernels::conv2d_at(conv, x, Precision::kBFloat16);
  y.backward(dy.to(torch::kBFloat16));
  const auto dw_bf16 = conv->weight.grad().clone();
  EXPECT_EQ(dw_bf16.scalar_type(), torch::kFloat32);  // the master weight's dtype
  const Conv2dGeometry g{{2, 2}, {0, 0}, {1, 1}};
  const auto swapped = kernels::conv2d_weight_grad_batch_swapped(dy.to(torch::kBFloat16), x.to(torch::kBFloat16), {5, 5}, g);
  EXPECT_TRUE(torch::equal(dw_bf16, swapped.to(torch::kFloat32)));
  EXPECT_TRUE(torch::allclose(conv->bias.grad(), dy.sum({0, 2, 3}), 3e-2, 1e-1));

  conv->zero_grad();
  kernels::conv2d_at(conv, x, Precision::kFloat32).backward(dy);
  const auto dw_fp32 = conv->weight.grad();
  const double rel = ((dw_bf16 - dw_fp32).abs().max() / dw_fp32.abs().max()).item<double>();
  EXPECT_LT(rel, 3e-2);  // bf16 inputs rounded to 8 significant bits, sums accumulated in fp32
}

// Geometries for the input gradient by phases (dilation 1): strides 1-3, kernels shorter than the stride
// (phases with no taps), padding, rows the forward never reads, non-square everything.
std::vector<Case> phase_cases() {
  return {
      {3, 5, 2, 20, 20, 9, 9, {{2, 2}, {0, 0}, {1, 1}}},  // PrimaryCaps' geometry
      {2, 3, 4, 21, 20, 9, 9, {{2, 2}, {0, 0}, {1, 1}}},  // an odd side: the last row is never read
      {2, 4, 3, 13, 10, 3, 2, {{2, 1}, {1, 2}, {1, 1}}},
      {1, 2, 3, 11, 11, 2, 2, {{3, 3}, {0, 0}, {1, 1}}},  // kernel 2 < stride 3: a phase without taps
      {2, 3, 2, 16, 12, 4, 4, {{2, 2}, {1, 1}, {1, 1}}},  // CapsPix2pix's down-sampling convolutions
      {2, 3, 5, 14, 17, 5, 4, {{3, 2}, {2, 1}, {1, 1}}},
      {2, 3, 4, 11, 9, 3, 3, {{1, 1}, {0, 0}, {1, 1}}},   // stride 1: one phase, a full correlation
  };
}

TEST(PhaseInputGrad, EqualsAtenInFloat64) {
  torch::manual_seed(7);
  for (const auto& t : phase_cases()) {
    const auto [x, w, dy] = random_problem(t, t.c);
    const auto fast = kernels::conv2d_input_grad_by_phases(dy, w, {t.h, t.w}, t.geometry);
    const auto reference = kernels::conv2d_input_grad_reference(dy, w, {t.h, t.w}, t.geometry);
    ASSERT_EQ(fast.sizes(), x.sizes());
    EXPECT_LT((fast - reference).abs().max().item<double>(), 1e-10)
        << "case h=" << t.h << " k=" << t.k0 << "x" << t.k1 << " stride " << t.geometry.stride[0];
  }
}

TEST(PhaseInputGrad, GradcheckWithEitherWeightGradient) {
  torch::manual_seed(8);
  for (const auto& t : phase_cases()) {
    for (const bool swapped : {false, true}) {
      auto x = torch::randn({t.n, t.c, t.h, t.w}, torch::kDouble).requires_grad_();
      auto w = torch::randn({t.o, t.c, t.k0, t.k1}, torch::kDouble).requires_grad_();
      auto b = torch::randn({t.o}, torch::kDouble).requires_grad_();
      const kernels::ConvGradientPaths paths{swapped, /*input_by_phases=*/true};
      const auto y = kernels::conv2d_with_gradient_paths(x, w, b, t.geometry, paths);
      EXPECT_TRUE(torch::allclose(y, conv_output(x, w, t.geometry) + b.view({1, -1, 1, 1})));
      const auto fn = [&](const std::vector<torch::Tensor>& in) {
        return kernels::conv2d_with_gradient_paths(in[0], in[1], in[2], t.geometry, paths);
      };
      EXPECT_TRUE(testing::gradcheck(fn, {x, w, b})) << "case h=" << t.h << " swapped " << swapped;
    }
  }
}

TEST(PhaseInputGrad, RefusesDilationAndMismatchedShapes) {
  const auto w = torch::randn({4, 3, 3, 3});
  EXPECT_THROW(kernels::conv2d_input_grad_by_phases(torch::randn({2, 4, 3, 3}), w, {9, 9}, {{2, 2}, {0, 0}, {2, 2}}),
               c10::Error);
  EXPECT_THROW(kernels::conv2d_input_grad_by_phases(torch::randn({2, 5, 3, 3}), w, {7, 7}, {{2, 2}, {0, 0}, {1, 1}}),
               c10::Error);  // dy has 5 channels, w 4 outputs
  EXPECT_THROW(kernels::conv2d_input_grad_by_phases(torch::randn({2, 4, 6, 6}), w, {7, 7}, {{2, 2}, {0, 0}, {1, 1}}),
               c10::Error);  // a 6 x 6 output needs at least 13 x 13 input
  EXPECT_THROW(kernels::conv2d_with_gradient_paths(torch::randn({1, 3, 9, 9}), w, {}, {{1, 1}, {0, 0}, {2, 2}},
                                              {false, true}),
               c10::Error);
}

// conv2d_at takes the phases for PrimaryCaps-like convolutions in both precisions: the input gradient is
// bit-identical to conv2d_input_grad_by_phases of the same (cast) tensors, and fp32 agrees with ATen's.
TEST(PhaseInputGrad, Conv2dAtTakesItInBothPrecisions) {
  torch::manual_seed(9);
  const int64_t channels = kernels::kBatchSwappedMinInChannels;
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(channels, 16, 5).stride(2));
  const Conv2dGeometry g{{2, 2}, {0, 0}, {1, 1}};
  const auto dy = torch::randn({4, 16, 6, 6});
  for (const auto precision : testing::cpu_precisions()) {
    const auto dtype = compute_dtype(precision);
    auto x = torch::rand({4, channels, 15, 15}).requires_grad_();
    kernels::conv2d_at(conv, x, precision).backward(dy.to(dtype));
    const auto phases = kernels::conv2d_input_grad_by_phases(dy.to(dtype), conv->weight.to(dtype), {15, 15}, g);
    EXPECT_TRUE(torch::equal(x.grad(), phases.to(torch::kFloat32))) << precision_name(precision);
    const auto aten = kernels::conv2d_input_grad_reference(dy, conv->weight.detach(), {15, 15}, g);
    const double rel = ((x.grad() - aten).abs().max() / aten.abs().max()).item<double>();
    EXPECT_LT(rel, precision == Precision::kFloat32 ? 1e-5 : 3e-2) << precision_name(precision);
  }
}

TEST(PhaseInputGrad, OnlyStridedWideConvolutionsWithASmallOutputUseIt) {
  auto conv = [](int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad, int64_t dilation = 1) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).dilation(dilation))
        ->options;
  };
  EXPECT_TRUE(kernels::use_phase_input_grad(conv(256, 256, 9, 2, 0), 20, 20));      // PrimaryCaps
  EXPECT_FALSE(kernels::use_phase_input_grad(conv(32, 8, 3, 1, 1), 8, 8));          // stride 1
  EXPECT_FALSE(kernels::use_phase_input_grad(conv(256, 256, 3, 2, 0, 2), 20, 20));  // dilation 2
  EXPECT_FALSE(kernels::use_phase_input_grad(conv(1, 256, 9, 2, 0), 28, 28));       // one input channel
  EXPECT_FALSE(kernels::use_phase_input_grad(conv(64, 64, 4, 2, 1), 64, 64));       // a 32 x 32 output
}

// Which convolutions take it: the measured geometries of docs/kernels.md.
TEST(BatchSwappedConv, OnlyWideConvolutionsWithASmallOutputUseIt) {
  auto conv = [](int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad, int64_t groups = 1) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).groups(groups))->options;
  };
  EXPECT_TRUE(kernels::use_batch_swapped_weight_grad(conv(256, 256, 9, 2, 0), 20, 20));  // PrimaryCaps: 6 x 6
  EXPECT_FALSE(kernels::use_batch_swapped_weight_grad(conv(1, 256, 9, 1, 0), 28, 28));   // Conv1: 1 channel
  EXPECT_FALSE(kernels::use_batch_swapped_weight_grad(conv(256, 256, 5, 1, 2), 20, 20)); // CNN conv2: 20 x 20
  EXPECT_FALSE(kernels::use_batch_swapped_weight_grad(conv(256, 128, 5, 1, 2), 10, 10)); // CNN conv3: 10 x 10
  EXPECT_TRUE(kernels::use_batch_swapped_weight_grad(conv(32, 8, 3, 1, 1), 8, 8));       // 8 x 8 = the limit
  EXPECT_FALSE(kernels::use_batch_swapped_weight_grad(conv(32, 8, 3, 1, 1), 9, 8));
  EXPECT_FALSE(kernels::use_batch_swapped_weight_grad(conv(256, 256, 9, 2, 0, 2), 20, 20));
}

}  // namespace
}  // namespace capsnet
