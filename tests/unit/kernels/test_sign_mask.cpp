// kernels/sign_mask.h (ReLU's backward from one bit per element) and the ReLU fused into the spectral
// convolution (kernels::conv2d_spectral_relu, conv2d_at's relu_input): the same values and gradients as a ReLU
// in front, float64 gradcheck, a kept graph, and the input's in-place check.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/ops/routing.h"
#include "capsnet/kernels/sign_mask.h"
#include "capsnet/kernels/spectral_conv.h"
#include "gradcheck.h"

namespace capsnet {
namespace {

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Caps the kernels' instruction set for a scope (the portable copies run where AVX-512 would).
struct IsaCap {
  explicit IsaCap(ops::CpuIsa isa) { ops::set_cpu_isa(isa); }
  ~IsaCap() { ops::set_cpu_isa(ops::CpuIsa::automatic); }
};
const ops::CpuIsa kIsas[] = {ops::CpuIsa::automatic, ops::CpuIsa::baseline};

// Bits against !(x <= 0) element by element, for sizes with and without a partial last byte, and the
// special values ReLU's backward meets: zero and negative zero pass nothing, +inf and NaN pass the
// gradient (threshold_backward's x <= 0 is false for NaN).
TEST(SignMask, BitsAreTheInputsSignsInEveryDtype) {
  torch::manual_seed(1);
  for (const auto isa : kIsas) for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
    const IsaCap cap(isa);
    for (const int64_t n : {1, 7, 8, 9, 64, 100003}) {
      auto x = torch::randn({n}).to(dtype);
      if (n >= 8) {
        x[0] = 0.0;
        x[1] = -0.0;
        x[2] = std::numeric_limits<double>::quiet_NaN();
        x[3] = std::numeric_limits<double>::infinity();
        x[4] = 1e-30;  // a tiny positive (bf16 keeps fp32's exponent range)
      }
      const auto bits = kernels::positive_bits(x);
      ASSERT_EQ(bits.numel(), (n + 7) / 8);
      const auto positive = x.le(0).logical_not().to(torch::kLong);
      const auto got = bits.accessor<uint8_t, 1>();
      const auto want = positive.accessor<int64_t, 1>();
      int64_t wrong = 0;
      for (int64_t i = 0; i < n; ++i) wrong += ((got[i / 8] >> (i % 8)) & 1) != want[i];
      EXPECT_EQ(wrong, 0) << dtype << " n=" << n << " isa " << static_cast<int>(isa);
      if (8 * bits.numel() > n)  // the padding bits of the last byte are zero
        EXPECT_EQ(bits[-1].item<int64_t>() >> (n % 8), 0) << dtype << " n=" << n;
    }
  }
}

// keep_where_positive_(g, bits(x)) is ReLU's backward: threshold_backward(g, x, 0), bit for bit, on a
// multi-dimensional tensor (contiguous order).
TEST(SignMask, KeepWherePositiveIsRelusBackward) {
  torch::manual_seed(2);
  for (const auto isa : kIsas) for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
    const IsaCap cap(isa);
    for (const auto& shape : {std::vector<int64_t>{3, 5, 7, 9}, std::vector<int64_t>{100, 700}}) {  // 945, 70000
      const auto x = torch::randn(shape).to(dtype);
      auto g = torch::randn(shape).to(dtype);
      // NaN inputs and NaN gradients: ATen passes a gradient where the input is NaN and writes 0 where
      // the input is <= 0 whatever the gradient; so must the bits.
      const double nan = std::numeric_limits<double>::quiet_NaN();
      x.view({-1}).slice(0, 0, 40, 4).fill_(nan);
      g.view({-1}).slice(0, 0, 40, 3).fill_(nan);
      const auto ref = at::threshold_backward(g, x, 0);
      kernels::keep_where_positive_(g, kernels::positive_bits(x));
      EXPECT_TRUE(torch::allclose(g, ref, 0, 0, /*equal_nan=*/true)) << dtype << " isa " << static_cast<int>(isa);
      EXPECT_EQ(g.isnan().sum().item<int64_t>(), ref.isnan().sum().item<int64_t>()) << dtype;
    }
  }
}

TEST(SignMask, RefusesBadInput) {
  auto g = torch::randn({10});
  EXPECT_THROW(kernels::keep_where_positive_(g, torch::zeros({1}, torch::kUInt8)), c10::Error);  // too few bytes
  EXPECT_THROW(kernels::keep_where_positive_(g, torch::zeros({2}, torch::kInt)), c10::Error);    // not uint8
  auto strided = torch::randn({4, 4}).t();
  EXPECT_THROW(kernels::keep_where_positive_(strided, torch::zeros({2}, torch::kUInt8)), c10::Error);
  EXPECT_THROW(kernels::positive_bits(torch::zeros({3}, torch::kInt)), c10::Error);  // not floating point
}

// PrimaryCaps' geometry (fewer channels) and a stride-1 odd one: conv2d_spectral_relu(z) against ATen's
// conv2d(relu(z)) in float64: output and the three gradients.
TEST(SpectralConvRelu, EqualsAReluInFrontInFloat64) {
  torch::manual_seed(3);
  struct Case { int64_t n, c, o, h, w, k, s; };
  for (const Case t : {Case{3, 5, 2, 20, 20, 9, 2}, Case{2, 3, 4, 11, 9, 3, 1}}) {
    const auto z = torch::randn({t.n, t.c, t.h, t.w}, torch::kDouble).requires_grad_();
    const auto w = torch::randn({t.o, t.c, t.k, t.k}, torch::kDouble).requires_grad_();
    const auto b = torch::randn({t.o}, torch::kDouble).requires_grad_();
    const auto y = kernels::conv2d_spectral_relu(z, w, b, {t.s, t.s});
    const auto ref = at::conv2d(torch::relu(z), w, b, {t.s, t.s});
    EXPECT_LT(max_abs_diff(y, ref), 1e-10);
    const auto dy = torch::randn_like(ref);
    const auto g = torch::autograd::grad({y}, {z, w, b}, {dy});
    const auto r = torch::autograd::grad({ref}, {z, w, b}, {dy});
    for (int i = 0; i < 3; ++i) EXPECT_LT(max_abs_diff(g[i], r[i]), 1e-10) << "gradient " << i;
    // ReLU's gradient is exactly zero where z <= 0.
    EXPECT_EQ(g[0].masked_select(z.detach() <= 0).abs().max().item<double>(), 0.0);
  }
}

// Finite differences: z kept away from ReLU's kink (|z| >= 0.2, the gradcheck's steps are ~1e-6).
TEST(SpectralConvRelu, PassesGradcheck) {
  torch::manual_seed(4);
  auto z0 = torch::randn({2, 3, 9, 8}, torch::kDouble);
  const auto z = (z0.sign() * (z0.abs() + 0.2)).requires_grad_();
  const auto w = torch::randn({2, 3, 3, 4}, torch::kDouble).requires_grad_();
  const auto b = torch::randn({2}, torch::kDouble).requires_grad_();
  EXPECT_TRUE(testing::gradcheck(
      [](const std::vector<torch::Tensor>& in) { return kernels::conv2d_spectral_relu(in[0], in[1], in[2], {2, 1}); },
      {z, w, b}));
}

// The backward lets the input go unless the graph is kept: with retain_graph, a second backward makes x's
// spectrum again from relu(z) and gives the same gradients as the first, both equal to ATen's.
TEST(SpectralConvRelu, ASecondBackwardThroughAKeptGraph) {
  torch::manual_seed(5);
  const auto z = torch::randn({2, 3, 11, 10}, torch::kDouble).requires_grad_();
  const auto w = torch::randn({4, 3, 5, 4}, torch::kDouble).requires_grad_();
  const auto y = kernels::conv2d_spectral_relu(z, w, {}, {2, 2});
  const auto ref = at::conv2d(torch::relu(z), w, {}, {2, 2});
  const auto dy = torch::randn_like(ref);
  const auto r = torch::autograd::grad({ref}, {z, w}, {dy});
  for (int pass = 0; pass < 2; ++pass) {
    const auto g = torch::autograd::grad({y}, {z, w}, {dy}, /*retain_graph=*/true);
    EXPECT_LT(max_abs_diff(g[0], r[0]), 1e-10) << "pass " << pass;
    EXPECT_LT(max_abs_diff(g[1], r[1]), 1e-10) << "pass " << pass;
  }
  // Without retain_graph the last backward still works (and then releases the graph).
  const auto g = torch::autograd::grad({y}, {z, w}, {dy});
  EXPECT_LT(max_abs_diff(g[0], r[0]), 1e-10);
}

// The input is kept outside the saved variables, with its version checked as theirs would be: an in-place
// change after the forward is an error in the backward, not a wrong gradient. Both forms.
TEST(SpectralConvRelu, AnInputChangedInPlaceAfterTheForwardIsAnError) {
  torch::manual_seed(6);
  const auto leaf = torch::randn({2, 3, 11, 10}, torch::kDouble).requires_grad_();
  const auto w = torch::randn({4, 3, 5, 4}, torch::kDouble).requires_grad_();
  for (const bool relu : {false, true}) {
    auto z = leaf * 1.0;
    const auto y = relu ? kernels::conv2d_spectral_relu(z, w, {}, {2, 2}) : kernels::conv2d_spectral(z, w, {}, {2, 2});
    {
      torch::NoGradGuard no_grad;
      z.mul_(2.0);
    }
    EXPECT_THROW(y.sum().backward(), c10::Error) << "relu " << relu;
  }
}

// conv2d_at with relu_input: the fused spectral form under autograd (PrimaryCaps' shape, fewer channels)
// equals a ReLU in front in values and gradients (fp32, to rounding: the same products in another order
// of ops); without autograd and where the spectral form does not run, the ReLU runs first, the same values.
TEST(SpectralConvRelu, Conv2dAtWithReluInputEqualsAReluInFront) {
  torch::manual_seed(7);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(32, 8, 9).stride(2));
  ASSERT_TRUE(kernels::use_spectral_conv(conv->options, 20, 20));
  const auto z = torch::randn({2, 32, 20, 20}).requires_grad_();
  const auto y = kernels::conv2d_at(conv, z, Precision::kFloat32, nullptr, /*relu_input=*/true);
  const auto ref = kernels::conv2d_at(conv, torch::relu(z), Precision::kFloat32);
  EXPECT_TRUE(torch::equal(y, ref));
  const auto dy = torch::randn_like(ref);
  const auto g = torch::autograd::grad({y}, {z, conv->weight}, {dy});
  const auto r = torch::autograd::grad({ref}, {z, conv->weight}, {dy});
  EXPECT_TRUE(torch::equal(g[0], r[0]));
  EXPECT_TRUE(torch::equal(g[1], r[1]));
  // A 3 x 3 convolution (not spectral): the ReLU in front.
  torch::nn::Conv2d small(torch::nn::Conv2dOptions(4, 3, 3));
  const auto x = torch::randn({2, 4, 8, 8});
  EXPECT_TRUE(torch::equal(kernels::conv2d_at(small, x, Precision::kFloat32, nullptr, true),
                           small->forward(torch::relu(x))));
  // Inference (autograd off).
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(kernels::conv2d_at(conv, z, Precision::kFloat32, nullptr, true),
                           kernels::conv2d_at(conv, torch::relu(z), Precision::kFloat32)));
}

}  // namespace
}  // namespace capsnet
