// kernels/unfolded_conv.h: the patches equal ATen's im2col, the convolution and its three gradients equal
// ATen's in float64 (and pass a finite-difference gradcheck), fp32 and bf16 stay within their rounding of
// float64, bad input is refused, and kernels::conv2d_at trains Conv1-like layers on it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/kernels/unfolded_conv.h"
#include "gradcheck.h"
#include "precisions.h"

namespace capsnet {
namespace {

struct Case {
  int64_t n, c, o, h, w, k0, k1, s0, s1, p0, p1;
};

std::vector<Case> cases() {
  return {
      {3, 1, 4, 12, 12, 9, 9, 1, 1, 0, 0},    // Conv1's geometry, smaller
      {2, 3, 5, 11, 9, 3, 2, 2, 1, 1, 2},     // every axis different, stride and padding
      {2, 1, 3, 10, 10, 5, 5, 1, 1, 2, 2},    // the baseline CNN's conv1 ("same" 5 x 5)
      {1, 2, 2, 7, 8, 1, 1, 3, 2, 0, 0},      // 1 x 1 kernel, stride beyond it
      {31, 1, 16, 28, 28, 9, 9, 1, 1, 0, 0},  // Conv1's, in float64: 3 chunks of images
  };
}

double relative(const torch::Tensor& a, const torch::Tensor& ref) {
  return ((a.to(torch::kDouble) - ref).abs().max() / ref.abs().max()).item<double>();
}

TEST(UnfoldedConv, PatchesEqualIm2col) {
  torch::manual_seed(1);
  for (const auto& t : cases()) {
    const auto x = torch::randn({t.n, t.c, t.h, t.w}, torch::kDouble);
    const auto cols = kernels::unfolded_patches(x, {t.k0, t.k1}, {t.s0, t.s1}, {t.p0, t.p1}, /*ones_row=*/true);
    const auto ref = at::im2col(x, {t.k0, t.k1}, {1, 1}, {t.p0, t.p1}, {t.s0, t.s1});  // [N, C k0 k1, L]
    ASSERT_EQ(cols.size(1), ref.size(1) + 1);
    EXPECT_TRUE(torch::equal(cols.narrow(1, 0, ref.size(1)), ref)) << "c=" << t.c << " k=" << t.k0 << "x" << t.k1;
    EXPECT_TRUE(torch::equal(cols.select(1, ref.size(1)), torch::ones({t.n, ref.size(2)}, torch::kDouble)));
  }
}

// The last case's float64 patches (82 x 400 x 8 bytes per image) and the weight gradient's products with
// them (82 x (400 x 8 + 16 x 4)) come in more than one chunk of images.
static_assert(31 * 82 * 400 * 8 > kernels::kUnfoldedChunkBytes, "the chunked case must chunk");

TEST(UnfoldedConv, ValuesAndGradientsEqualAtenInFloat64) {
  torch::manual_seed(2);
  for (const auto& t : cases()) {
    for (const bool bias : {true, false}) {
      const auto x = torch::randn({t.n, t.c, t.h, t.w}, torch::kDouble).requires_grad_();
      const auto w = torch::randn({t.o, t.c, t.k0, t.k1}, torch::kDouble).requires_grad_();
      const auto b = bias ? torch::randn({t.o}, torch::kDouble).requires_grad_() : torch::Tensor();
      const auto y = kernels::conv2d_unfolded(x, w, b, {t.s0, t.s1}, {t.p0, t.p1});
      const auto ref = at::conv2d(x, w, b, {t.s0, t.s1}, {t.p0, t.p1});
      ASSERT_EQ(y.sizes(), ref.sizes());
      EXPECT_LT((y - ref).abs().max().item<double>(), 1e-12);
      const auto dy = torch::randn_like(ref);
      const auto fast = torch::autograd::grad(
          {y}, bias ? std::vector<torch::Tensor>{x, w, b} : std::vector<torch::Tensor>{x, w}, {dy});
      const auto slow = torch::autograd::grad(
          {ref}, bias ? std::vector<torch::Tensor>{x, w, b} : std::vector<torch::Tensor>{x, w}, {dy});
      for (size_t i = 0; i < fast.size(); ++i)
        EXPECT_LT((fast[i] - slow[i]).abs().max().item<double>(), 1e-11) << "gradient " << i << " c=" << t.c;
    }
  }
}

TEST(UnfoldedConv, PassesGradcheck) {
  torch::manual_seed(3);
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const auto x = torch::randn({2, 2, 7, 6}, opts).requires_grad_();
  const auto w = torch::randn({3, 2, 3, 2}, opts).requires_grad_();
  const auto b = torch::randn({3}, opts).requires_grad_();
  EXPECT_TRUE(testing::gradcheck(
      [](const std::vector<torch::Tensor>& in) {
        return kernels::conv2d_unfolded(in[0], in[1], in[2], {2, 1}, {1, 0});
      },
      {x, w, b}));
}

// fp32: the products on oneDNN's sgemm, against float64 ATen. bf16 (bf16 x, fp32 master weight): against
// float64 of the same bf16-rounded x and w; the output is rounded to bf16 once (2^-9 of each value), the
// gradients summed in fp32 from bf16 dy; dw and db come back in fp32. Bounds about 3x the largest errors seen.
TEST(UnfoldedConv, Float32AndBf16StayWithinTheirRoundingOfFloat64) {
  torch::manual_seed(4);
  for (const auto dtype : testing::with_native_bf16({torch::kFloat})) {
    for (const auto& t :
         std::vector<Case>{{8, 1, 256, 28, 28, 9, 9, 1, 1, 0, 0}, {4, 1, 64, 12, 12, 5, 5, 1, 1, 2, 2}}) {
      const auto x = torch::rand({t.n, t.c, t.h, t.w}).to(dtype).requires_grad_();
      const auto w = (torch::randn({t.o, t.c, t.k0, t.k1}) * 0.1).requires_grad_();
      const auto b = torch::randn({t.o}).requires_grad_();
      const auto y = kernels::conv2d_unfolded(x, w, b, {1, 1}, {t.p0, t.p1});
      EXPECT_EQ(y.scalar_type(), dtype);
      const auto dy = torch::randn(y.sizes()).to(dtype);
      y.backward(dy);
      EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);
      EXPECT_EQ(x.grad().scalar_type(), dtype);
      const auto f64 = [](const torch::Tensor& v) { return v.detach().to(torch::kDouble).requires_grad_(); };
      const auto xr = f64(x), wr = f64(w.to(dtype)), br = f64(b.to(dtype));
      const auto ref = at::conv2d(xr, wr, br, {1, 1}, {t.p0, t.p1});
      ref.backward(dy.to(torch::kDouble));
      const bool bf16 = dtype == torch::kBFloat16;
      const std::string what = std::string(bf16 ? "bf16" : "fp32") + " k=" + std::to_string(t.k0);
      std::cout << what << ": largest errors of the largest value: y " << relative(y, ref) << ", dx "
                << relative(x.grad(), xr.grad()) << ", dw " << relative(w.grad(), wr.grad()) << ", db "
                << relative(b.grad(), br.grad()) << "\n";
      EXPECT_LT(relative(y, ref), bf16 ? 6e-3 : 1e-6) << what;
      EXPECT_LT(relative(x.grad(), xr.grad()), bf16 ? 6e-3 : 1e-6) << what;
      EXPECT_LT(relative(w.grad(), wr.grad()), 1e-6) << what;  // fp32 sums of exact products
      EXPECT_LT(relative(b.grad(), br.grad()), 1e-6) << what;
    }
  }
}

// conv2d_at trains Conv1 on it in bf16 (the same values and gradients as calling it directly), not in fp32
// or without autograd; the predicate takes shallow convolutions only.
TEST(UnfoldedConv, Conv2dAtTrainsConv1OnItInBf16Only) {
  auto options = [](int64_t in, int64_t k, int64_t pad, int64_t groups = 1, int64_t dilation = 1) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, 8, k).padding(pad).groups(groups).dilation(dilation))
        ->options;
  };
  EXPECT_TRUE(kernels::use_unfolded_conv(options(1, 9, 0)));         // Conv1
  EXPECT_TRUE(kernels::use_unfolded_conv(options(1, 5, 2)));         // the baseline CNN's conv1
  EXPECT_TRUE(kernels::use_unfolded_conv(options(3, 5, 2)));         // colour input: 75
  EXPECT_FALSE(kernels::use_unfolded_conv(options(2, 9, 0)));        // 162 > kUnfoldedMaxDepth
  EXPECT_FALSE(kernels::use_unfolded_conv(options(2, 3, 1, 2)));     // groups
  EXPECT_FALSE(kernels::use_unfolded_conv(options(1, 3, 1, 1, 2)));  // dilation
  if (!cpu_has_native_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16 / AMX";
  torch::manual_seed(5);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(1, 16, 9));
  const auto x = torch::rand({4, 1, 28, 28});
  const auto dy = torch::randn({4, 16, 20, 20}).to(torch::kBFloat16);
  const auto y = kernels::conv2d_at(conv, x, Precision::kBFloat16);
  y.backward(dy);
  const auto dw = conv->weight.grad().clone(), db = conv->bias.grad().clone();
  conv->zero_grad();
  const auto direct = kernels::conv2d_unfolded(x.to(torch::kBFloat16), conv->weight, conv->bias, {1, 1}, {0, 0});
  direct.backward(dy);
  EXPECT_TRUE(torch::equal(y, direct));
  EXPECT_TRUE(torch::equal(dw, conv->weight.grad()));
  EXPECT_TRUE(torch::equal(db, conv->bias.grad()));
  // fp32 and inference: oneDNN's kernel (ATen's convolution), not this one.
  EXPECT_EQ(kernels::conv2d_at(conv, x, Precision::kFloat32).grad_fn()->name(),
            at::conv2d(x, conv->weight).grad_fn()->name());
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(
      kernels::conv2d_at(conv, x, Precision::kBFloat16),
      at::conv2d(x.to(torch::kBFloat16), conv->weight.to(torch::kBFloat16), conv->bias.to(torch::kBFloat16))));
}

// Without autograd, from kSpectralInferenceMinBatch images on, conv2d_at runs shallow convolutions on it in
// either precision, with a dense output, and applies relu_input to its input; below that batch, with blocked
// weights offered, oneDNN's blocked kernel (a blocked output). Values: the direct call's, bit for bit, and
// ATen's within the precision's rounding.
TEST(UnfoldedConv, Conv2dAtInfersOnItFromTheMinimumBatch) {
  torch::manual_seed(6);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(1, 16, 5).padding(2));  // the baseline CNN's conv1, narrower
  torch::NoGradGuard no_grad;
  for (const auto precision : testing::cpu_precisions()) {
    const auto dtype = compute_dtype(precision);
    for (const int64_t n : {kernels::kSpectralInferenceMinBatch - 1, kernels::kSpectralInferenceMinBatch}) {
      for (const bool relu : {false, true}) {
        const auto x = torch::randn({n, 1, 12, 12});  // negative entries: the ReLU matters
        kernels::BlockedConvWeights blocked;
        const auto y = kernels::conv2d_at(conv, x, precision, &blocked, relu);
        const bool unfolded = n >= kernels::kSpectralInferenceMinBatch;
        const std::string what = std::to_string(n) + " " + precision_name(precision) + (relu ? " relu" : "");
        ASSERT_EQ(y.is_mkldnn(), !unfolded) << what;
        EXPECT_EQ(blocked.reorders(), unfolded ? 0 : 1) << what;
        const auto xr = relu ? torch::relu(x) : x;
        if (unfolded)
          EXPECT_TRUE(torch::equal(y, kernels::conv2d_unfolded(xr.to(dtype), conv->weight, conv->bias, {1, 1}, {2, 2})))
              << what;
        const auto ref = at::conv2d(xr.to(torch::kDouble), conv->weight.to(torch::kDouble),
                                    conv->bias.to(torch::kDouble), 1, 2);
        EXPECT_LT(relative(y.is_mkldnn() ? y.to_dense() : y, ref), precision == Precision::kFloat32 ? 1e-6 : 1e-2)
            << what;
      }
    }
  }
}

TEST(UnfoldedConv, RefusesBadInput) {
  const auto x = torch::randn({2, 1, 8, 8});
  EXPECT_THROW(kernels::conv2d_unfolded(x, torch::randn({4, 2, 3, 3}), {}, {1, 1}, {0, 0}), c10::Error);  // channels
  EXPECT_THROW(kernels::conv2d_unfolded(x, torch::randn({4, 1, 3, 3}), torch::randn({3}), {1, 1}, {0, 0}), c10::Error);
  EXPECT_THROW(kernels::conv2d_unfolded(x, torch::randn({4, 1, 9, 9}), {}, {1, 1}, {0, 0}), c10::Error);  // too big
  EXPECT_THROW(kernels::conv2d_unfolded(x, torch::randn({4, 1, 3, 3}), {}, {0, 1}, {0, 0}), c10::Error);  // stride 0
  EXPECT_THROW(kernels::conv2d_unfolded(x.view({2, 64}), torch::randn({4, 1, 3, 3}), {}, {1, 1}, {0, 0}), c10::Error);
  const auto xg = x.clone().requires_grad_(), w = torch::randn({4, 1, 3, 3}).requires_grad_();
  const auto y = kernels::conv2d_unfolded(xg, w, {}, {1, 1}, {0, 0});
  // Differentiating the gradient again would go through kernels autograd cannot see: refused.
  EXPECT_THROW(torch::autograd::grad({y.sum()}, {xg}, {}, true, /*create_graph=*/true), c10::Error);
}

}  // namespace
}  // namespace capsnet
