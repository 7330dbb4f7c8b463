// kernels::linear_gemm (oneDNN's sgemm under torch::linear's contract) against ATen, and linear_at's use of it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "capsnet/kernels/linear.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "gradcheck.h"

using namespace capsnet;

TEST(LinearGemm, GradientsMatchFiniteDifferencesInFloat64) {
  torch::manual_seed(1);
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  const auto x = torch::randn({5, 7}, opts).requires_grad_(), w = torch::randn({3, 7}, opts).requires_grad_(),
             b = torch::randn({3}, opts).requires_grad_();
  EXPECT_TRUE(capsnet::testing::gradcheck([](const std::vector<torch::Tensor>& in) { return kernels::linear_gemm(in[0], in[1], in[2]); },
                                  {x, w, b}));
  EXPECT_TRUE(capsnet::testing::gradcheck(
      [](const std::vector<torch::Tensor>& in) { return kernels::linear_gemm(in[0], in[1], torch::Tensor()); }, {x, w}));
}

TEST(LinearGemm, Float32EqualsAtenWithinRounding) {
  // The decoder's shapes, a transposed (non-contiguous) input and no bias; values and all three gradients
  // against float64 ATen, relative to each tensor's largest entry.
  torch::manual_seed(2);
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& r) {
    return ((a.to(torch::kDouble) - r).abs().max() / r.abs().max()).item<double>();
  };
  for (const auto& [n, i, o, bias, transposed] : std::vector<std::tuple<int, int, int, bool, bool>>{
           {100, 160, 512, true, false}, {100, 1024, 784, true, false}, {3, 9, 4, false, true}, {1, 1, 1, true, false}}) {
    auto x = transposed ? torch::randn({i, n}).t() : torch::randn({n, i});
    x.requires_grad_();
    const auto w = torch::randn({o, i}).requires_grad_();
    const auto b = bias ? torch::randn({o}).requires_grad_() : torch::Tensor();
    const auto b_before = bias ? b.detach().clone() : torch::Tensor();
    const auto y = kernels::linear_gemm(x, w, b);
    const auto xr = x.detach().to(torch::kDouble).requires_grad_(), wr = w.detach().to(torch::kDouble).requires_grad_();
    const auto br = bias ? b.detach().to(torch::kDouble).requires_grad_() : torch::Tensor();
    const auto ref = torch::linear(xr, wr, br);
    EXPECT_LT(rel(y, ref), 1e-5) << n << "x" << i << "x" << o;
    if (bias) EXPECT_TRUE(torch::equal(b, b_before)) << "the bias was written to";
    const auto dy = torch::randn({n, o});
    std::vector<torch::Tensor> ins{x, w}, ref_ins{xr, wr};
    if (bias) ins.push_back(b), ref_ins.push_back(br);
    const auto g = torch::autograd::grad({y}, ins, {dy});
    const auto r = torch::autograd::grad({ref}, ref_ins, {dy.to(torch::kDouble)});
    for (size_t k = 0; k < g.size(); ++k) {
      EXPECT_EQ(g[k].scalar_type(), torch::kFloat);
      EXPECT_LT(rel(g[k], r[k]), 1e-5) << n << "x" << i << "x" << o << " gradient " << k;
    }
  }
}

TEST(LinearGemm, LinearAtTakesItForFloat32MatricesOnly) {
  torch::manual_seed(3);
  torch::nn::Linear layer(torch::nn::LinearOptions(6, 4));
  const auto x = torch::randn({5, 6});
  EXPECT_TRUE(torch::equal(kernels::linear_at(layer, x, Precision::kFloat32), kernels::linear_gemm(x, layer->weight, layer->bias)));
  // A 3-D input stays on torch::linear (same values within rounding).
  const auto x3 = torch::randn({2, 5, 6});
  EXPECT_TRUE(torch::allclose(kernels::linear_at(layer, x3, Precision::kFloat32), layer->forward(x3), 1e-6, 1e-6));
}

TEST(LinearGemm, RefusesBadInput) {
  const auto w = torch::randn({3, 4});
  EXPECT_THROW(kernels::linear_gemm(torch::randn({2, 5}), w, {}), c10::Error);                        // I differs
  EXPECT_THROW(kernels::linear_gemm(torch::randn({2, 2, 4}), w, {}), c10::Error);                     // 3-D
  EXPECT_THROW(kernels::linear_gemm(torch::randn({2, 4}), w, torch::randn({4})), c10::Error);         // bias size
  EXPECT_THROW(kernels::linear_gemm(torch::randn({2, 4}, torch::kDouble), w, {}), c10::Error);        // dtypes
  EXPECT_THROW(kernels::linear_gemm(torch::randint(3, {2, 4}), w.to(torch::kLong), {}), c10::Error);  // integers
}
