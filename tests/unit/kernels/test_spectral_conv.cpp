// kernels/spectral_conv.h and kernels/gemm.h: the convolution through DFTs equals ATen's in float64 (output, input,
// weight and bias gradients, for every geometry the formulas cover), passes a finite-difference gradcheck,
// stays within fp32 rounding of ATen in float32 and within bf16 rounding of float64 with a bf16 input, its
// spectra equal torch::fft's, and the products into strided views equal torch::mm (bf16 operands: exact
// products summed in fp32); conv2d_at takes it for PrimaryCaps-like convolutions in both precisions.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <iostream>
#include <limits>

#include "capsnet/kernels/batch_swapped_conv.h"
#include "capsnet/kernels/blocked_conv.h"
#include "capsnet/kernels/gemm.h"
#include "capsnet/kernels/linear.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/kernels/spectral_conv.h"
#include "gradcheck.h"
#include "precisions.h"

namespace capsnet {
namespace {

struct Case {
  int64_t n, c, o, h, w, k0, k1, s0, s1;
};

std::vector<Case> cases() {
  return {
      {3, 5, 2, 20, 20, 9, 9, 2, 2},  // PrimaryCaps' geometry: the last row and column are never read
      {2, 3, 4, 11, 9, 3, 3, 1, 1},   // stride 1, odd and non-square
      {2, 4, 3, 13, 10, 3, 2, 2, 1},  // every axis different
      {1, 2, 2, 8, 8, 1, 1, 3, 3},    // 1 x 1 kernel, stride beyond it
      {2, 3, 5, 12, 12, 4, 4, 2, 2},  // even circle (Nyquist column), CapsPix2pix-like kernel
      {2, 2, 3, 7, 9, 7, 9, 1, 1},    // kernel as large as the input: a 1 x 1 output
  };
}

std::string name(const Case& t) {
  return "n=" + std::to_string(t.n) + " c=" + std::to_string(t.c) + " o=" + std::to_string(t.o) + " " +
         std::to_string(t.h) + "x" + std::to_string(t.w) + " k=" + std::to_string(t.k0) + "x" + std::to_string(t.k1) +
         " s=" + std::to_string(t.s0) + "x" + std::to_string(t.s1);
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

TEST(SpectralConv, SpectrumEqualsTorchFft) {
  torch::manual_seed(1);
  const auto t = torch::randn({2, 3, 7, 6}, torch::kDouble);
  for (const auto& [n0, n1] : std::vector<std::array<int64_t, 2>>{{7, 6}, {9, 8}, {10, 7}}) {
    const auto spec = kernels::real_spectrum(t, {n0, n1}, {1, 1}, {7, 6});  // [2, n0 K, 2, 3]
    const int64_t K = n1 / 2 + 1;
    const auto padded = at::constant_pad_nd(t, {0, n1 - 6, 0, n0 - 7});
    const auto ref = torch::fft::rfft2(padded).permute({2, 3, 0, 1}).reshape({n0 * K, 2, 3});
    EXPECT_LT(max_abs_diff(spec[0], torch::real(ref)), 1e-11) << n0 << "x" << n1;
    EXPECT_LT(max_abs_diff(spec[1], torch::imag(ref)), 1e-11) << n0 << "x" << n1;
  }
  // Samples placed at a stride: the spectrum of the zero-interleaved signal.
  const auto spread = torch::zeros({2, 3, 13, 11}, torch::kDouble);
  spread.slice(2, 0, 13, 2).slice(3, 0, 11, 2).copy_(t.slice(3, 0, 6));
  const auto strided = kernels::real_spectrum(t, {13, 11}, {2, 2}, {7, 6});
  const auto ref = torch::fft::rfft2(spread).permute({2, 3, 0, 1}).reshape({13 * 6, 2, 3});
  EXPECT_LT(max_abs_diff(strided[0], torch::real(ref)), 1e-11);
  EXPECT_LT(max_abs_diff(strided[1], torch::imag(ref)), 1e-11);
}

TEST(SpectralConv, InverseRecoversTheSignal) {
  torch::manual_seed(2);
  for (const auto& [n0, n1] : std::vector<std::array<int64_t, 2>>{{7, 6}, {8, 9}}) {
    const auto t = torch::randn({2, 3, n0, n1}, torch::kDouble);
    const auto spec = kernels::real_spectrum(t, {n0, n1}, {1, 1}, {n0, n1});
    auto out = torch::full({2, 3, n0 + 1, n1 + 2}, 7.0, torch::kDouble);
    kernels::inverse_real_spectrum_into(out, spec, {n0, n1}, {1, 1}, {n0, n1});
    EXPECT_LT(max_abs_diff(out.slice(2, 0, n0).slice(3, 0, n1), t), 1e-12);
    EXPECT_TRUE(torch::all(out.slice(2, n0) == 7.0).item<bool>()) << "rows past count are left alone";
    // Every second sample only.
    auto half = torch::empty({2, 3, (n0 + 1) / 2, (n1 + 1) / 2}, torch::kDouble);
    kernels::inverse_real_spectrum_into(half, spec, {n0, n1}, {2, 2}, {(n0 + 1) / 2, (n1 + 1) / 2});
    EXPECT_LT(max_abs_diff(half, t.slice(2, 0, n0, 2).slice(3, 0, n1, 2)), 1e-12);
  }
}

TEST(SpectralConv, ForwardAndGradientsEqualAtenInFloat64) {
  torch::manual_seed(3);
  for (const auto& t : cases()) {
    const auto x = torch::randn({t.n, t.c, t.h, t.w}, torch::kDouble).requires_grad_();
    const auto w = torch::randn({t.o, t.c, t.k0, t.k1}, torch::kDouble).requires_grad_();
    const auto b = torch::randn({t.o}, torch::kDouble).requires_grad_();
    const auto y = kernels::conv2d_spectral(x, w, b, {t.s0, t.s1});
    const auto ref = at::conv2d(x, w, b, {t.s0, t.s1});
    ASSERT_EQ(y.sizes(), ref.sizes()) << name(t);
    EXPECT_LT(max_abs_diff(y, ref), 1e-10) << name(t);
    const auto dy = torch::randn_like(ref);
    const auto g = torch::autograd::grad({y}, {x, w, b}, {dy});
    const auto r = torch::autograd::grad({ref}, {x, w, b}, {dy});
    for (int i = 0; i < 3; ++i) EXPECT_LT(max_abs_diff(g[i], r[i]), 1e-10) << name(t) << " gradient " << i;
  }
}

// The frequencies go through the products in chunks of columns (the weight's spectrum a chunk at a
// time; a column is 2 x 11 x 40 x 3 doubles, 21120 bytes): one column per chunk, four (6 columns = 4 + 2),
// one chunk and the default all equal ATen.
TEST(SpectralConv, ChunksOverFrequencyColumnsGiveTheSameResult) {
  torch::manual_seed(8);
  const auto x = torch::randn({2, 3, 11, 10}, torch::kDouble).requires_grad_();
  const auto w = torch::randn({40, 3, 5, 4}, torch::kDouble).requires_grad_();
  const auto ref = at::conv2d(x, w, {}, {2, 2});
  const auto dy = torch::randn_like(ref);
  const auto r = torch::autograd::grad({ref}, {x, w}, {dy});
  for (const int64_t chunk_bytes : {int64_t{1}, int64_t{4 * 21120}, int64_t{1} << 30, kernels::kSpectralChunkBytes}) {
    const auto y = kernels::conv2d_spectral(x, w, {}, {2, 2}, chunk_bytes);
    EXPECT_LT(max_abs_diff(y, ref), 1e-10) << chunk_bytes;
    const auto g = torch::autograd::grad({y}, {x, w}, {dy});
    EXPECT_LT(max_abs_diff(g[0], r[0]), 1e-10) << chunk_bytes;
    EXPECT_LT(max_abs_diff(g[1], r[1]), 1e-10) << chunk_bytes;
  }
}

// The backward takes x's spectrum from the forward and frees it after dW; a second backward through the
// same graph (retain_graph) makes it again from x: both equal ATen's gradients.
TEST(SpectralConv, ASecondBackwardMakesTheSpectrumAgain) {
  torch::manual_seed(12);
  const auto x = torch::randn({2, 3, 11, 10}, torch::kDouble).requires_grad_();
  const auto w = torch::randn({4, 3, 5, 4}, torch::kDouble).requires_grad_();
  const auto y = kernels::conv2d_spectral(x, w, {}, {2, 2});
  const auto ref = at::conv2d(x, w, {}, {2, 2});
  const auto dy = torch::randn_like(ref);
  const auto r = torch::autograd::grad({ref}, {x, w}, {dy});
  for (int pass = 0; pass < 2; ++pass) {
    const auto g = torch::autograd::grad({y}, {x, w}, {dy}, /*retain_graph=*/true);
    EXPECT_LT(max_abs_diff(g[0], r[0]), 1e-10) << "pass " << pass;
    EXPECT_LT(max_abs_diff(g[1], r[1]), 1e-10) << "pass " << pass;
  }
}

// bf16 keeps w^T's spectrum from the forward for the input gradient (read transposed) and
// frees it; a second backward makes W's spectrum again. Both passes within bf16 rounding of float64 (the
// bound of Bf16StaysWithinItsRoundingOfFloat64), and the two passes' dx within rounding of each other.
TEST(SpectralConv, Bf16ASecondBackwardMakesTheWeightSpectrumAgain) {
  torch::manual_seed(13);
  const auto x = torch::randn({3, 6, 20, 20}).to(torch::kBFloat16).requires_grad_();
  const auto w = torch::randn({5, 6, 9, 9}).requires_grad_();
  const auto y = kernels::conv2d_spectral(x, w, {}, {2, 2}, /*chunk_bytes=*/1);
  const auto xr = x.detach().to(torch::kDouble).requires_grad_();
  const auto wr = w.detach().to(torch::kBFloat16).to(torch::kDouble).requires_grad_();
  const auto ref = at::conv2d(xr, wr, {}, {2, 2});
  const auto dy = torch::randn(ref.sizes()).to(torch::kBFloat16);
  const auto r = torch::autograd::grad({ref}, {xr, wr}, {dy.to(torch::kDouble)});
  const auto relative = [](const torch::Tensor& a, const torch::Tensor& b) {
    return ((a.to(torch::kDouble) - b).abs().max() / b.abs().max()).item<double>();
  };
  std::vector<torch::Tensor> dx;
  for (int pass = 0; pass < 2; ++pass) {
    const auto g = torch::autograd::grad({y}, {x, w}, {dy}, /*retain_graph=*/true);
    EXPECT_LT(relative(g[0], r[0]), 8.5e-3) << "pass " << pass;
    EXPECT_LT(relative(g[1], r[1]), 8.5e-3) << "pass " << pass;
    dx.push_back(g[0].to(torch::kDouble));
  }
  EXPECT_LT(relative(dx[1], dx[0]), 8.5e-3);
}

TEST(SpectralConv, PassesGradcheck) {
  torch::manual_seed(4);
  const auto x = torch::randn({2, 3, 9, 8}, torch::kDouble).requires_grad_();
  const auto w = torch::randn({2, 3, 3, 4}, torch::kDouble).requires_grad_();
  const auto b = torch::randn({2}, torch::kDouble).requires_grad_();
  EXPECT_TRUE(testing::gradcheck(
      [](const std::vector<torch::Tensor>& in) { return kernels::conv2d_spectral(in[0], in[1], in[2], {2, 1}); },
      {x, w, b}));
  // Without a bias.
  EXPECT_TRUE(testing::gradcheck(
      [](const std::vector<torch::Tensor>& in) { return kernels::conv2d_spectral(in[0], in[1], {}, {2, 2}); }, {x, w}));
}

// fp32 at PrimaryCaps' kernel, stride and input size (fewer channels): within fp32 rounding of ATen's.
TEST(SpectralConv, Float32StaysWithinRoundingOfAten) {
  torch::manual_seed(5);
  const auto x = torch::rand({4, 64, 20, 20}).requires_grad_();
  const auto w = (torch::randn({32, 64, 9, 9}) * 0.02).requires_grad_();
  const auto y = kernels::conv2d_spectral(x, w, {}, {2, 2});
  const auto ref = at::conv2d(x, w, {}, {2, 2});
  const auto relative = [](const torch::Tensor& a, const torch::Tensor& r) {
    return ((a - r).abs().max() / r.abs().max()).item<double>();
  };
  EXPECT_LT(relative(y, ref), 1e-5);
  const auto dy = torch::randn_like(ref);
  const auto g = torch::autograd::grad({y}, {x, w}, {dy});
  const auto r = torch::autograd::grad({ref}, {x, w}, {dy});
  EXPECT_LT(relative(g[0], r[0]), 1e-5);
  EXPECT_LT(relative(g[1], r[1]), 1e-5);
}

// A bf16 input (spectra and products in bf16, sums in fp32) with the fp32 master weight, every geometry:
// within bf16 rounding of float64 on the same rounded input and weight, y and dx in bf16, dW and db in
// fp32. Measured 3-6e-3 of each tensor's largest entry (oneDNN's direct bf16 convolution: ~2.5e-3; a wrong
// term gives O(1)).
// bf16 spectra and products against float64 on the same (bf16-rounded) operands, with the default chunking
// and with one frequency column per chunk (PrimaryCaps' size takes five chunks in production). Errors are
// relative to the largest reference value; each bound is about 1.5x the largest error measured over these
// cases (printed), so a doubling of the rounding error fails.
TEST(SpectralConv, Bf16StaysWithinItsRoundingOfFloat64) {
  const auto relative = [](const torch::Tensor& a, const torch::Tensor& r) {
    return ((a.to(torch::kDouble) - r).abs().max() / r.abs().max()).item<double>();
  };
  // Largest errors measured (2-core AMD EPYC Zen 5, oneDNN's bf16 matmul), either chunking: y 6.48e-3,
  // dx 5.83e-3, dw 5.81e-3, db 0 (dy's bf16 values summed in fp32 are exact here).
  const double bound[4] = {9.5e-3, 8.5e-3, 8.5e-3, 1e-6};  // y, dx, dw, db
  const char* what[4] = {"y", "dx", "dw", "db"};
  for (const int64_t chunk_bytes : {kernels::kSpectralChunkBytes, int64_t{1}}) {
    torch::manual_seed(10);
    double worst[4] = {0, 0, 0, 0};
    for (const auto& t : cases()) {
      const auto x = torch::randn({t.n, t.c, t.h, t.w}).to(torch::kBFloat16).requires_grad_();
      const auto w = torch::randn({t.o, t.c, t.k0, t.k1}).requires_grad_();
      const auto b = torch::randn({t.o}).requires_grad_();
      const auto y = kernels::conv2d_spectral(x, w, b, {t.s0, t.s1}, chunk_bytes);
      ASSERT_EQ(y.scalar_type(), torch::kBFloat16) << name(t);
      const auto xr = x.detach().to(torch::kDouble).requires_grad_();
      const auto wr = w.detach().to(torch::kBFloat16).to(torch::kDouble).requires_grad_();
      const auto br = b.detach().to(torch::kDouble).requires_grad_();
      const auto ref = at::conv2d(xr, wr, br, {t.s0, t.s1});
      const auto dy = torch::randn(ref.sizes()).to(torch::kBFloat16);
      const auto g = torch::autograd::grad({y}, {x, w, b}, {dy});
      const auto r = torch::autograd::grad({ref}, {xr, wr, br}, {dy.to(torch::kDouble)});
      EXPECT_EQ(g[0].scalar_type(), torch::kBFloat16);
      EXPECT_EQ(g[1].scalar_type(), torch::kFloat);
      EXPECT_EQ(g[2].scalar_type(), torch::kFloat);
      const double err[4] = {relative(y, ref), relative(g[0], r[0]), relative(g[1], r[1]), relative(g[2], r[2])};
      for (int i = 0; i < 4; ++i) {
        EXPECT_LT(err[i], bound[i]) << name(t) << " " << what[i] << " chunk_bytes " << chunk_bytes;
        worst[i] = std::max(worst[i], err[i]);
      }
    }
    std::cout << "bf16 spectral conv, chunk_bytes " << chunk_bytes << ": largest relative errors y " << worst[0]
              << " dx " << worst[1] << " dw " << worst[2] << " db " << worst[3] << "\n";
  }
}

TEST(SpectralConv, RefusesBadInput) {
  const auto x = torch::randn({1, 3, 9, 9});
  EXPECT_THROW(kernels::conv2d_spectral(x, torch::randn({2, 4, 3, 3}), {}, {1, 1}), c10::Error);     // channels
  EXPECT_THROW(kernels::conv2d_spectral(x, torch::randn({2, 3, 11, 3}), {}, {1, 1}), c10::Error);    // kernel > input
  EXPECT_THROW(kernels::conv2d_spectral(x, torch::randn({2, 3, 3, 3}), {}, {0, 1}), c10::Error);     // stride 0
  // bf16 takes a bf16 input with the fp32 master weight, nothing else.
  EXPECT_THROW(kernels::conv2d_spectral(x.to(torch::kBFloat16), torch::randn({2, 3, 3, 3}).to(torch::kBFloat16), {},
                                   {1, 1}),
               c10::Error);
  EXPECT_THROW(kernels::conv2d_spectral(x.to(torch::kBFloat16), torch::randn({2, 3, 3, 3}, torch::kDouble), {}, {1, 1}),
               c10::Error);
  EXPECT_THROW(kernels::conv2d_spectral(x, torch::randn({2, 3, 3, 3}).to(torch::kBFloat16), {}, {1, 1}), c10::Error);
  EXPECT_THROW(kernels::conv2d_spectral(x, torch::randn({2, 3, 3, 3}, torch::kDouble), {}, {1, 1}), c10::Error);
}

TEST(SpectralConv, OnlyLargeKernelsOnSmallOutputsInFp32UseIt) {
  auto conv = [](int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad, int64_t dilation = 1) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).dilation(dilation))
        ->options;
  };
  EXPECT_TRUE(kernels::spectral_conv_pays_off({9, 9}, {6, 6}, {2, 2}));            // 2916 vs 570 per channel pair
  EXPECT_FALSE(kernels::spectral_conv_pays_off({3, 3}, {6, 6}, {1, 1}));           // 324 vs 192
  EXPECT_TRUE(kernels::use_spectral_conv(conv(256, 256, 9, 2, 0), 20, 20));        // PrimaryCaps
  EXPECT_TRUE(kernels::use_spectral_conv(conv(256, 256, 9, 2, 0), 28, 28));        // MultiMNIST's, 10 x 10 out
  EXPECT_TRUE(kernels::use_spectral_conv(conv(256, 256, 9, 2, 0), 32, 32));        // 40 x 40 images, 12 x 12 out
  EXPECT_TRUE(kernels::use_spectral_conv(conv(256, 256, 9, 2, 0), 34, 34));        // 42 x 42 (STN), 13 x 13 out
  EXPECT_FALSE(kernels::use_spectral_conv(conv(1, 256, 9, 1, 0), 28, 28));         // Conv1: one input channel
  EXPECT_FALSE(kernels::use_spectral_conv(conv(256, 256, 9, 2, 1), 20, 20));       // padding
  EXPECT_FALSE(kernels::use_spectral_conv(conv(256, 256, 9, 2, 0, 2), 20, 20));    // dilation
  EXPECT_FALSE(kernels::use_spectral_conv(conv(32, 16, 5, 2, 0), 15, 15));         // 900 vs 360: too few saved
  EXPECT_FALSE(kernels::use_spectral_conv(conv(256, 256, 5, 1, 2), 20, 20));       // the CNN's 20 x 20 output
}

// conv2d_at takes it where use_spectral_conv says so, in fp32 and in bf16 (the same values as
// conv2d_spectral of the cast input and the fp32 master weight, bit for bit; the weight's gradient in fp32).
TEST(SpectralConv, Conv2dAtTakesItInBothPrecisions) {
  torch::manual_seed(6);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(32, 8, 9).stride(2));
  const auto x = torch::rand({2, 32, 20, 20});
  ASSERT_TRUE(kernels::use_spectral_conv(conv->options, 20, 20));
  const auto y = kernels::conv2d_at(conv, x, Precision::kFloat32);
  EXPECT_TRUE(torch::equal(y, kernels::conv2d_spectral(x, conv->weight, conv->bias, {2, 2})));
  const auto ref = conv->forward(x);
  EXPECT_LT(((y - ref).abs().max() / ref.abs().max()).item<double>(), 1e-5);
  if (cpu_has_native_bf16()) {
    const auto yb = kernels::conv2d_at(conv, x, Precision::kBFloat16);
    EXPECT_EQ(yb.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(yb, kernels::conv2d_spectral(x.to(torch::kBFloat16), conv->weight, conv->bias, {2, 2})));
    EXPECT_LT(((yb.to(torch::kFloat) - ref).abs().max() / ref.abs().max()).item<double>(), 3e-2);
    yb.sum().backward();
    EXPECT_EQ(conv->weight.grad().scalar_type(), torch::kFloat32);
  }
}

// Inference (autograd off) takes it from kSpectralInferenceMinBatch examples on, even when the caller
// offers blocked weights (dense output, no blocked reorder made); below that the blocked direct kernel.
TEST(SpectralConv, InferenceTakesItFromTheMinimumBatch) {
  torch::manual_seed(9);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(32, 8, 9).stride(2));
  ASSERT_TRUE(kernels::use_spectral_conv(conv->options, 20, 20));
  torch::NoGradGuard no_grad;
  for (const auto precision : testing::cpu_precisions()) {
    const auto dtype = compute_dtype(precision);
    for (const int64_t n : {kernels::kSpectralInferenceMinBatch - 1, kernels::kSpectralInferenceMinBatch}) {
      const auto x = torch::rand({n, 32, 20, 20});
      kernels::BlockedConvWeights blocked;
      const auto y = kernels::conv2d_at(conv, x, precision, &blocked);
      const bool spectral = n >= kernels::kSpectralInferenceMinBatch;
      ASSERT_EQ(y.is_mkldnn(), !spectral) << n << " " << precision_name(precision);
      EXPECT_EQ(blocked.reorders(), spectral ? 0 : 1) << n;
      EXPECT_EQ(blocked.spectra(), spectral ? 1 : 0) << n;  // the weight's spectrum, kept
      if (spectral)
        EXPECT_TRUE(torch::equal(y, kernels::conv2d_spectral_inference(x.to(dtype), blocked.spectrum(conv, dtype, {20, 20}),
                                                                  conv->bias, {9, 9}, {2, 2})));
      const auto ref = conv->forward(x);
      const auto yd = (y.is_mkldnn() ? y.to_dense() : y).to(torch::kFloat);
      EXPECT_LT(((yd - ref).abs().max() / ref.abs().max()).item<double>(),
                precision == Precision::kFloat32 ? 1e-5 : 3e-2)
          << n << " " << precision_name(precision);
    }
  }
}

// The forward from a kept weight spectrum equals conv2d_spectral's (fp32 and fp64: to rounding; bf16:
// within bf16 rounding of float64), for every geometry; with relu_input, the same call on relu(x).
TEST(SpectralConv, InferenceFromAKeptSpectrumEqualsTheForward) {
  torch::manual_seed(13);
  torch::NoGradGuard no_grad;
  for (const auto dtype : testing::with_native_bf16({torch::kDouble, torch::kFloat})) {
    const auto master = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
    for (const auto& t : cases()) {
      const auto x = torch::randn({t.n, t.c, t.h, t.w}, master).to(dtype);
      const auto w = torch::randn({t.o, t.c, t.k0, t.k1}, master), b = torch::randn({t.o}, master);
      const auto spectrum = kernels::conv2d_spectral_weight_spectrum(w, {t.h, t.w}, {t.s0, t.s1}, dtype);
      const auto y = kernels::conv2d_spectral_inference(x, spectrum, b, {t.k0, t.k1}, {t.s0, t.s1});
      ASSERT_EQ(y.scalar_type(), dtype) << name(t);
      // bf16 keeps the third Gauss operand (real minus imaginary, as the per-call subtraction rounds it): the
      // forward from it equals the one that makes it per chunk from the two parts, bit for bit.
      ASSERT_EQ(spectrum.size(0), dtype == torch::kBFloat16 ? 3 : 2) << name(t);
      if (dtype == torch::kBFloat16) {
        EXPECT_TRUE(torch::equal(spectrum[2], spectrum[0] - spectrum[1])) << name(t);
        EXPECT_TRUE(torch::equal(y, kernels::conv2d_spectral_inference(x, spectrum.narrow(0, 0, 2), b, {t.k0, t.k1},
                                                                      {t.s0, t.s1})))
            << name(t);
      }
      const auto forward = kernels::conv2d_spectral(x, w, b, {t.s0, t.s1});
      const auto ref = at::conv2d(x.to(torch::kDouble), w.to(dtype).to(torch::kDouble), b.to(torch::kDouble),
                                  {t.s0, t.s1});
      const double scale = ref.abs().max().item<double>();
      if (dtype == torch::kBFloat16) {
        EXPECT_LT(max_abs_diff(y.to(torch::kDouble), ref) / scale, 1e-2) << name(t);
      } else {
        EXPECT_LT(max_abs_diff(y, forward) / scale, dtype == torch::kDouble ? 1e-13 : 1e-6) << name(t);
      }
      // relu_input: the ReLU inside x's last-axis stage gives the same call on relu(x) bit for bit.
      const auto fused = kernels::conv2d_spectral_inference(x, spectrum, b, {t.k0, t.k1}, {t.s0, t.s1},
                                                            kernels::kSpectralChunkBytes, /*relu_input=*/true);
      EXPECT_TRUE(torch::equal(fused, kernels::conv2d_spectral_inference(torch::relu(x), spectrum, b, {t.k0, t.k1},
                                                                        {t.s0, t.s1})))
          << name(t);
      EXPECT_FALSE(torch::equal(fused, y)) << name(t);
      // An x that nothing else holds takes the ReLU in place: the same output; one that a view still holds, or
      // whose storage another tensor shares, is left as it was.
      auto owned = x.clone();
      EXPECT_TRUE(torch::equal(fused, kernels::conv2d_spectral_inference(std::move(owned), spectrum, b, {t.k0, t.k1},
                                                                        {t.s0, t.s1}, kernels::kSpectralChunkBytes,
                                                                        /*relu_input=*/true)))
          << name(t);
      auto shared = x.clone();
      const auto view = shared.view(-1);
      EXPECT_TRUE(torch::equal(fused, kernels::conv2d_spectral_inference(std::move(shared), spectrum, b,
                                                                        {t.k0, t.k1}, {t.s0, t.s1},
                                                                        kernels::kSpectralChunkBytes, true)))
          << name(t);
      EXPECT_TRUE(torch::equal(view, x.reshape(-1))) << name(t);
      auto aliased = x.clone();
      auto alias = torch::empty({0}, x.options()).set_(aliased.storage(), 0, aliased.sizes(), aliased.strides());
      EXPECT_TRUE(torch::equal(fused, kernels::conv2d_spectral_inference(std::move(aliased), spectrum, b,
                                                                        {t.k0, t.k1}, {t.s0, t.s1},
                                                                        kernels::kSpectralChunkBytes, true)))
          << name(t);
      EXPECT_TRUE(torch::equal(alias, x)) << name(t);
    }
  }
}

// conv2d_at's inference path fuses PrimaryCaps' ReLU into the kept-spectrum forward (relu_input).
TEST(SpectralConv, InferenceFusesTheInputsRelu) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(17);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(32, 8, 9).stride(2));
  const auto x = torch::randn({kernels::kSpectralInferenceMinBatch, 32, 20, 20});
  kernels::BlockedConvWeights blocked;
  const auto y = kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked, /*relu_input=*/true);
  EXPECT_TRUE(torch::equal(y, kernels::conv2d_spectral_inference(torch::relu(x), blocked.spectrum(conv, torch::kFloat, {20, 20}),
                                                                conv->bias, {9, 9}, {2, 2})));
}

TEST(SpectralConv, InferenceRefusesAMismatchedSpectrum) {
  const auto w = torch::randn({4, 3, 5, 5});
  const auto spectrum = kernels::conv2d_spectral_weight_spectrum(w, {13, 13}, {2, 2}, torch::kFloat);
  torch::NoGradGuard no_grad;
  EXPECT_NO_THROW(kernels::conv2d_spectral_inference(torch::randn({2, 3, 13, 13}), spectrum, {}, {5, 5}, {2, 2}));
  EXPECT_THROW(kernels::conv2d_spectral_inference(torch::randn({2, 3, 15, 15}), spectrum, {}, {5, 5}, {2, 2}),
               c10::Error);  // made for another input size
  EXPECT_THROW(kernels::conv2d_spectral_inference(torch::randn({2, 4, 13, 13}), spectrum, {}, {5, 5}, {2, 2}),
               c10::Error);  // channels
  EXPECT_THROW(kernels::conv2d_spectral_inference(torch::randn({2, 3, 13, 13}), spectrum.narrow(0, 0, 1), {}, {5, 5},
                                                  {2, 2}),
               c10::Error);  // one part
  EXPECT_THROW(kernels::conv2d_spectral_inference(torch::randn({2, 3, 13, 13}, torch::kDouble), spectrum, {}, {5, 5},
                                             {2, 2}),
               c10::Error);  // dtype
  EXPECT_THROW(kernels::conv2d_spectral_inference(torch::randn({2, 3, 13, 13}), spectrum, {}, {5, 5}, {0, 2}),
               c10::Error);  // stride 0
  EXPECT_THROW(kernels::conv2d_spectral_inference(torch::randn({2, 3, 4, 13}), spectrum, {}, {5, 5}, {2, 2}),
               c10::Error);  // kernel larger than the input
}

// BlockedConvWeights keeps the spectrum across calls and makes it again after the weight changes (an
// optimizer step bumps its version) or for another dtype.
TEST(SpectralConv, TheKeptSpectrumFollowsTheWeight) {
  torch::manual_seed(14);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(32, 8, 9).stride(2));
  kernels::BlockedConvWeights blocked;
  torch::NoGradGuard no_grad;
  const auto x = torch::rand({kernels::kSpectralInferenceMinBatch, 32, 20, 20});
  kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked);
  kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked);
  EXPECT_EQ(blocked.spectra(), 1);
  conv->weight.mul_(-1.0);  // in place: a new version
  const auto y = kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked);
  EXPECT_EQ(blocked.spectra(), 2);
  const auto ref = conv->forward(x);
  EXPECT_LT((y - ref).abs().max().item<double>() / ref.abs().max().item<double>(), 1e-5);
  if (cpu_has_native_bf16()) {
    kernels::conv2d_at(conv, x, Precision::kBFloat16, &blocked);
    EXPECT_EQ(blocked.spectra(), 3);
  }
}

// prepare_conv2d_at makes, without an input, the spectrum that conv2d_at would keep for one of those sizes
// (the call after it makes none), and nothing under autograd, for a batch too small for the spectral
// inference or where the convolution does not take the spectral form.
TEST(SpectralConv, PrepareMakesTheSpectrumTheCallWouldKeep) {
  torch::manual_seed(15);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(32, 8, 9).stride(2));
  const int64_t B = kernels::kSpectralInferenceMinBatch;
  kernels::BlockedConvWeights blocked;
  kernels::prepare_conv2d_at(conv, {B, 32, 20, 20}, Precision::kFloat32, &blocked);
  EXPECT_EQ(blocked.spectra(), 0) << "autograd on: conv2d_at would keep nothing";
  torch::NoGradGuard no_grad;
  kernels::prepare_conv2d_at(conv, {B - 1, 32, 20, 20}, Precision::kFloat32, &blocked);
  kernels::prepare_conv2d_at(conv, {B, 32, 9, 9}, Precision::kFloat32, &blocked);  // a 1 x 1 output: direct
  EXPECT_EQ(blocked.spectra(), 0);
  kernels::prepare_conv2d_at(conv, {B, 32, 20, 20}, Precision::kFloat32, &blocked);
  EXPECT_EQ(blocked.spectra(), 1);
  const auto x = torch::rand({B, 32, 20, 20});
  const auto y = kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked);
  EXPECT_EQ(blocked.spectra(), 1) << "the call found the prepared spectrum";
  const auto ref = conv->forward(x);
  EXPECT_LT((y - ref).abs().max().item<double>() / ref.abs().max().item<double>(), 1e-5);
  if (cpu_has_native_bf16()) {
    kernels::prepare_conv2d_at(conv, {B, 32, 20, 20}, Precision::kBFloat16, &blocked);
    EXPECT_EQ(blocked.spectra(), 2);
    kernels::conv2d_at(conv, x, Precision::kBFloat16, &blocked);
    EXPECT_EQ(blocked.spectra(), 2) << "bf16: the prepared spectrum has the dtype the call uses";
  }
}

TEST(Gemm, EqualsMatmulForEveryLayout) {
  torch::manual_seed(7);
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    const double tol = dtype == torch::kFloat ? 1e-4 : 1e-12;
    const auto a = torch::randn({5, 7}, dtype), b = torch::randn({7, 4}, dtype);
    const auto at_ = torch::randn({7, 5}, dtype).t(), bt = torch::randn({4, 7}, dtype).t();  // column-major
    for (const auto& [x, y] : std::vector<std::pair<torch::Tensor, torch::Tensor>>{{a, b}, {at_, b}, {a, bt}, {at_, bt}}) {
      auto out = torch::full({5, 4}, std::numeric_limits<double>::quiet_NaN(), dtype);
      kernels::gemm_into(out, x, y);  // beta 0 ignores the NaNs
      EXPECT_LT(max_abs_diff(out, torch::mm(x, y)), tol);
      const auto before = out.clone();
      kernels::gemm_into(out, x, y, -2.0, 0.5);
      EXPECT_LT(max_abs_diff(out, 0.5 * before - 2.0 * torch::mm(x, y)), tol);
    }
    // Into a strided view (every second column of a wider matrix), the other columns untouched.
    auto wide = torch::zeros({5, 8}, dtype);
    auto view = wide.narrow(1, 2, 4);
    kernels::gemm_into(view, a, b);
    EXPECT_LT(max_abs_diff(wide.narrow(1, 2, 4), torch::mm(a, b)), tol);
    EXPECT_EQ(wide.narrow(1, 0, 2).abs().sum().item<double>(), 0.0);
    // Batched.
    const auto ba = torch::randn({3, 5, 7}, dtype), bb = torch::randn({3, 4, 7}, dtype).transpose(1, 2);
    auto bout = torch::empty({3, 5, 4}, dtype);
    kernels::batched_gemm_into(bout, ba, bb);
    EXPECT_LT(max_abs_diff(bout, torch::bmm(ba, bb)), tol);
    // Two batch axes of strides that do not merge, alpha and beta.
    const auto a4 = torch::randn({2, 4, 5, 7}, dtype).narrow(1, 1, 3);
    const auto b4 = torch::randn({2, 4, 7, 4}, dtype).narrow(1, 0, 3);
    auto out4 = torch::randn({2, 3, 5, 4}, dtype);
    const auto before4 = out4.clone();
    kernels::batched_gemm_into(out4, a4, b4, 2.0, -1.0);
    EXPECT_LT(max_abs_diff(out4, 2.0 * torch::matmul(a4, b4) - before4), tol);
    // A batch axis of size 1 broadcast: a's, then b's.
    const auto a1 = torch::randn({1, 5, 7}, dtype), b1 = torch::randn({1, 7, 4}, dtype);
    kernels::batched_gemm_into(bout, a1, bb);
    EXPECT_LT(max_abs_diff(bout, torch::matmul(a1, bb)), tol);
    kernels::batched_gemm_into(bout, ba, b1);
    EXPECT_LT(max_abs_diff(bout, torch::matmul(ba, b1)), tol);
  }
}

// bf16 operands: exact products summed in fp32 (out fp32: fp32 rounding of the float64 product of the
// same rounded operands; out bf16: one more rounding), every layout, alpha and beta, strided and batched.
TEST(Gemm, Bf16OperandsSumInFp32) {
  torch::manual_seed(11);
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  const auto f64 = [](const torch::Tensor& t) { return t.to(torch::kDouble); };
  const auto relative = [&](const torch::Tensor& a, const torch::Tensor& r) {
    return ((f64(a) - r).abs().max() / r.abs().max()).item<double>();
  };
  const auto a = bf(torch::randn({9, 70})), b = bf(torch::randn({70, 6}));
  const auto at_ = bf(torch::randn({70, 9})).t(), bt = bf(torch::randn({6, 70})).t();  // column-major
  const std::vector<std::pair<torch::Tensor, torch::Tensor>> layouts{{a, b}, {at_, b}, {a, bt}, {at_, bt}};
  for (const auto& [x, y] : layouts) {
    const auto ref = torch::mm(f64(x), f64(y));
    auto out = torch::full({9, 6}, std::numeric_limits<float>::quiet_NaN());
    kernels::gemm_into(out, x, y);  // beta 0 ignores the NaNs
    EXPECT_LT(relative(out, ref), 1e-6);
    const auto before = f64(out);
    kernels::gemm_into(out, x, y, -2.0, 0.5);
    EXPECT_LT(relative(out, 0.5 * before - 2.0 * ref), 1e-6);
    auto out_bf16 = torch::empty({9, 6}, torch::kBFloat16);
    kernels::gemm_into(out_bf16, x, y);
    EXPECT_LT(relative(out_bf16, ref), 1e-2);
  }
  // Into a strided view, the other columns untouched; batched with a transposed right operand.
  auto wide = torch::zeros({9, 10});
  auto view = wide.narrow(1, 3, 6);
  kernels::gemm_into(view, a, b);
  EXPECT_LT(relative(wide.narrow(1, 3, 6), torch::mm(f64(a), f64(b))), 1e-6);
  EXPECT_EQ(wide.narrow(1, 0, 3).abs().sum().item<double>(), 0.0);
  const auto ba = bf(torch::randn({3, 5, 40})), bb = bf(torch::randn({3, 4, 40})).transpose(1, 2);
  auto bout = torch::empty({3, 5, 4});
  kernels::batched_gemm_into(bout, ba, bb, 1.5);
  EXPECT_LT(relative(bout, 1.5 * torch::bmm(f64(ba), f64(bb))), 1e-6);
  // A batch axis of size 1 broadcast over out's (a's, then b's).
  const auto a1 = bf(torch::randn({1, 5, 40})), b1 = bf(torch::randn({1, 40, 4}));
  kernels::batched_gemm_into(bout, a1, bb);
  EXPECT_LT(relative(bout, torch::matmul(f64(a1), f64(bb))), 1e-6);
  kernels::batched_gemm_into(bout, ba, b1);
  EXPECT_LT(relative(bout, torch::matmul(f64(ba), f64(b1))), 1e-6);
  // Two batch axes whose strides do not merge into one (columns 1-2 of 5 on the second axis), into a view.
  const auto a4 = bf(torch::randn({3, 5, 6, 40})).narrow(1, 1, 2);
  const auto b4 = bf(torch::randn({3, 5, 4, 40})).narrow(1, 2, 2).transpose(-2, -1);
  auto out4_base = torch::zeros({3, 4, 6, 4});
  auto out4 = out4_base.narrow(1, 1, 2);
  kernels::batched_gemm_into(out4, a4, b4, 1.0, 0.0);
  EXPECT_LT(relative(out4, torch::matmul(f64(a4), f64(b4))), 1e-6);
  EXPECT_EQ(out4_base.narrow(1, 0, 1).abs().sum().item<double>(), 0.0);
  EXPECT_EQ(out4_base.narrow(1, 3, 1).abs().sum().item<double>(), 0.0);
  // An empty sum (K = 0): beta * out, and zeros for beta 0 whatever out held.
  auto nan_out = torch::full({9, 6}, std::numeric_limits<float>::quiet_NaN());
  kernels::gemm_into(nan_out, bf(torch::randn({9, 0})), bf(torch::randn({0, 6})));
  EXPECT_EQ(nan_out.abs().sum().item<double>(), 0.0);
  // bf16 operands need a bf16 partner and a bf16 or fp32 out.
  auto out32 = torch::empty({9, 6});
  EXPECT_THROW(kernels::gemm_into(out32, a, b.to(torch::kFloat)), c10::Error);
  auto out64 = torch::empty({9, 6}, torch::kDouble);
  EXPECT_THROW(kernels::gemm_into(out64, a, b), c10::Error);
}

TEST(Gemm, RefusesShapesThatDoNotChain) {
  auto out = torch::empty({5, 4});
  EXPECT_THROW(kernels::gemm_into(out, torch::randn({5, 7}), torch::randn({6, 4})), c10::Error);
  EXPECT_THROW(kernels::gemm_into(out, torch::randn({5, 7}), torch::randn({7, 4}, torch::kDouble)), c10::Error);
  auto bout = torch::empty({2, 5, 4});
  EXPECT_THROW(kernels::batched_gemm_into(bout, torch::randn({3, 5, 7}), torch::randn({3, 7, 4})), c10::Error);
  auto bout4 = torch::empty({2, 3, 5, 4});
  EXPECT_THROW(kernels::batched_gemm_into(bout4, torch::randn({2, 2, 5, 7}), torch::randn({2, 3, 7, 4})), c10::Error);
  EXPECT_THROW(kernels::batched_gemm_into(out, torch::randn({5, 7}), torch::randn({7, 4})), c10::Error);
}

// The hand-written autograd Functions (spectral convolution, convolution with gradient paths, the sgemm
// linear layer) compute their gradients with kernels autograd cannot see through: a double backward
// (create_graph) is refused by name instead of returning a silently wrong second derivative. A first
// backward with create_graph off still works.
TEST(SpectralConv, ADoubleBackwardIsRefusedByEveryHandWrittenFunction) {
  torch::manual_seed(12);
  const auto x = torch::randn({2, 3, 9, 9}, torch::kDouble).requires_grad_();
  const auto w = torch::randn({4, 3, 3, 3}, torch::kDouble).requires_grad_();
  const auto b = torch::randn({4}, torch::kDouble).requires_grad_();
  const auto lx = torch::randn({5, 6}).requires_grad_();
  const auto lw = torch::randn({4, 6}).requires_grad_();
  const auto lb = torch::randn({4}).requires_grad_();
  const std::vector<std::pair<std::string, std::function<torch::Tensor()>>> cases = {
      {"conv2d_spectral", [&] { return kernels::conv2d_spectral(x, w, b, {2, 2}); }},
      {"conv2d_spectral", [&] { return kernels::conv2d_spectral_relu(x, w, b, {2, 2}); }},
      {"conv2d_with_gradient_paths",
       [&] { return kernels::conv2d_with_gradient_paths(x, w, b, kernels::Conv2dGeometry{{2, 2}, {0, 0}, {1, 1}}, {true, true}); }},
      {"linear_gemm", [&] { return kernels::linear_gemm(lx, lw, lb); }},
  };
  for (const auto& [name, make] : cases) {
    auto y = make();
    auto inputs = name == "linear_gemm" ? std::vector<torch::Tensor>{lx, lw} : std::vector<torch::Tensor>{x, w};
    try {
      torch::autograd::grad({y.square().sum()}, inputs, {}, /*retain_graph=*/true, /*create_graph=*/true);
      ADD_FAILURE() << name << ": a double backward was not refused";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(name + ": double backward"), std::string::npos) << e.what();
    }
    const auto g = torch::autograd::grad({y.square().sum()}, inputs);
    EXPECT_TRUE(g[0].defined() && torch::isfinite(g[0]).all().item<bool>()) << name;
  }
}

}  // namespace
}  // namespace capsnet
