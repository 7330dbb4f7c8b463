// Capsule layers: PrimaryCaps (shape, atom order), CapsuleLinear (DigitCaps), Decoder,
// and float64 gradient checks of every differentiable building block.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "capsnet/nn/capsule_linear.h"
#include "capsnet/nn/decoder.h"
#include "capsnet/nn/functional.h"
#include "capsnet/nn/primary_caps.h"
#include "gradcheck.h"

namespace {

using capsnet::testing::gradcheck;
using capsnet::testing::GradcheckOptions;
namespace cn = capsnet::nn;

std::vector<torch::Tensor> parameters_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p);
  return out;
}

TEST(LayersTest, PrimaryCapsPaperShape) {
  torch::manual_seed(10);
  cn::PrimaryCaps pc(cn::PrimaryCapsOptions(256, 32, 8));  // 9x9, stride 2 by default
  EXPECT_EQ(pc->conv->options.kernel_size()->at(0), 9);
  EXPECT_EQ(pc->conv->options.stride()->at(0), 2);
  EXPECT_EQ(pc->conv->weight.sizes(), (std::vector<int64_t>{256, 256, 9, 9}));
  auto u = pc(torch::rand({2, 256, 20, 20}));
  EXPECT_EQ(u.sizes(), (std::vector<int64_t>{2, 1152, 8}));
  // Squashed: every capsule shorter than 1.
  EXPECT_LT(u.norm(2, -1).max().item<float>(), 1.0f);
  // 5,308,672 parameters = 256 * 256 * 81 + 256.
  int64_t n = 0;
  for (const auto& p : pc->parameters()) n += p.numel();
  EXPECT_EQ(n, 5308672);
}

TEST(LayersTest, PrimaryCapsAtomsLastOrder) {
  // Capsule (type t, y, x) atom a must be conv channel t * dim + a at position (y, x): the output is
  // permuted atoms-last before flattening. A plain view of [B, types*dim, H, W] to [B, -1, dim]
  // would instead group dim neighbouring *positions* of one channel into a capsule.
  torch::manual_seed(11);
  const int64_t types = 3, dim = 4, in_channels = 2;
  cn::PrimaryCaps pc(cn::PrimaryCapsOptions(in_channels, types, dim).kernel_size(3).stride(2));
  pc->to(torch::kDouble);
  auto x = torch::randn({2, in_channels, 9, 10}, torch::kDouble);
  auto conv = pc->conv(x);  // [2, 12, 4, 4]
  auto u = pc(x);
  const int64_t H = conv.size(2), W = conv.size(3);
  ASSERT_EQ(H, 4);
  ASSERT_EQ(W, 4);
  ASSERT_EQ(u.sizes(), (std::vector<int64_t>{2, types * H * W, dim}));
  auto ca = conv.accessor<double, 4>();
  auto ua = u.accessor<double, 3>();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < types; ++t)
      for (int64_t y = 0; y < H; ++y)
        for (int64_t xx = 0; xx < W; ++xx) {
          double sq = 0;
          for (int64_t a = 0; a < dim; ++a) sq += ca[b][t * dim + a][y][xx] * ca[b][t * dim + a][y][xx];
          const double scale = sq / (1 + sq) / std::sqrt(sq + capsnet::kNormEps);
          const int64_t capsule = (t * H + y) * W + xx;
          for (int64_t a = 0; a < dim; ++a)
            ASSERT_NEAR(ua[b][capsule][a], scale * ca[b][t * dim + a][y][xx], 1e-12)
                << "b " << b << " type " << t << " y " << y << " x " << xx << " atom " << a;
        }
  // The classic bug really is different.
  auto wrong = capsnet::squash(conv.reshape({2, -1, dim}));
  EXPECT_GT((wrong - u).abs().max().item<double>(), 1e-3);
}

TEST(LayersTest, PrimaryCapsRejectsBadOptions) {
  EXPECT_THROW(cn::PrimaryCaps(cn::PrimaryCapsOptions(0, 32, 8)), c10::Error);
  EXPECT_THROW(cn::PrimaryCaps(cn::PrimaryCapsOptions(8, 32, 8).stride(0)), c10::Error);
  EXPECT_THROW(cn::PrimaryCaps(cn::PrimaryCapsOptions(8, 32, 8).output_scale(0.0)), c10::Error);
  EXPECT_THROW(cn::PrimaryCaps(cn::PrimaryCapsOptions(8, 32, 8).output_scale(std::nan(""))), c10::Error);
}

TEST(LayersTest, PrimaryCapsOutputScale) {
  // output_scale s: squash(s (W x + b)) is the unscaled layer with weights s W and bias s b, in fp32 (the spectral
  // fast path for 9x9 / stride 2) and bf16 against that float64 reference, values and gradients.
  torch::manual_seed(16);
  cn::PrimaryCaps scaled(cn::PrimaryCapsOptions(16, 4, 8).output_scale(0.25));
  cn::PrimaryCaps plain(cn::PrimaryCapsOptions(16, 4, 8));
  {
    torch::NoGradGuard no_grad;
    plain->conv->weight.copy_(scaled->conv->weight * 0.25);
    plain->conv->bias.copy_(scaled->conv->bias * 0.25);
  }
  auto x = torch::rand({3, 16, 20, 20});
  auto ref = cn::PrimaryCaps(std::dynamic_pointer_cast<cn::PrimaryCapsImpl>(plain->clone()));
  ref->to(torch::kDouble);
  auto xd = x.to(torch::kDouble).requires_grad_(true);
  auto u_ref = ref(xd);
  auto r = torch::randn_like(u_ref);
  (u_ref * r).sum().backward();
  for (auto precision : {capsnet::Precision::kFloat32, capsnet::Precision::kBFloat16}) {
    SCOPED_TRACE(precision == capsnet::Precision::kFloat32 ? "fp32" : "bf16");
    const double tol = precision == capsnet::Precision::kFloat32 ? 1e-4 : 2e-2;
    scaled->zero_grad();
    auto xs = x.clone().requires_grad_(true);
    auto u = scaled(xs, precision);
    EXPECT_LT((u.to(torch::kDouble) - u_ref).abs().max().item<double>(), tol * u_ref.abs().max().item<double>());
    (u * r.to(torch::kFloat)).sum().backward();
    // d/dW of s W x is s times d/d(sW): the scaled layer's weight gradient is s times the reference's.
    auto gw = scaled->conv->weight.grad().to(torch::kDouble), gw_ref = ref->conv->weight.grad() * 0.25;
    EXPECT_LT((gw - gw_ref).abs().max().item<double>(), 4 * tol * gw_ref.abs().max().item<double>());
    EXPECT_LT((xs.grad().to(torch::kDouble) - xd.grad()).abs().max().item<double>(),
              4 * tol * xd.grad().abs().max().item<double>());
  }
}

TEST(LayersTest, CapsuleLinearPredictionsEqualLoop) {
  torch::manual_seed(12);
  const int64_t B = 3, I = 5, Din = 4, J = 3, D = 6;
  cn::CapsuleLinear layer(cn::CapsuleLinearOptions(I, Din, J, D).weight_std(0.5));
  layer->to(torch::kDouble);
  EXPECT_EQ(layer->weight.sizes(), (std::vector<int64_t>{I, J, D, Din}));
  auto u = torch::randn({B, I, Din}, torch::kDouble);
  auto u_hat = layer->predictions(u);
  ASSERT_EQ(u_hat.sizes(), (std::vector<int64_t>{B, I, J, D}));
  auto W = layer->weight.detach();
  auto wa = W.accessor<double, 4>();
  auto ua = u.accessor<double, 3>();
  auto pa = u_hat.detach().contiguous();
  auto ha = pa.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t j = 0; j < J; ++j)
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;  // u_hat_{j|i}[d] = sum_k W_ij[d, k] u_i[k]
          for (int64_t k = 0; k < Din; ++k) acc += wa[i][j][d][k] * ua[b][i][k];
          ASSERT_NEAR(ha[b][i][j][d], acc, 1e-12) << "b " << b << " i " << i << " j " << j << " d " << d;
        }
  auto einsum = torch::einsum("ijdk,bik->bijd", {W, u});
  EXPECT_TRUE(torch::allclose(u_hat, einsum, 1e-12, 1e-12));

  // forward = routing of the predictions with the layer's options.
  auto v = layer(u);
  EXPECT_EQ(v.sizes(), (std::vector<int64_t>{B, J, D}));
  capsnet::RoutingOptions o;
  o.iterations = 3;
  EXPECT_TRUE(torch::allclose(v, capsnet::detail::reference_routing(einsum, o), 1e-12, 1e-12));
  cn::CapsuleLinear one_iteration(cn::CapsuleLinearOptions(I, Din, J, D).routing({1}));
  one_iteration->to(torch::kDouble);
  {
    torch::NoGradGuard g;
    one_iteration->weight.copy_(layer->weight);
  }
  o.iterations = 1;
  EXPECT_TRUE(torch::allclose(one_iteration(u), capsnet::detail::reference_routing(einsum, o), 1e-12, 1e-12));
  EXPECT_FALSE(torch::allclose(one_iteration(u), v, 1e-6, 1e-6));
}

TEST(LayersTest, CapsuleLinearPaperShapeAndBadInput) {
  torch::manual_seed(13);
  cn::CapsuleLinear layer(cn::CapsuleLinearOptions(1152, 8, 10, 16));
  EXPECT_EQ(layer->weight.numel(), 1474560);
  auto v = layer(torch::rand({2, 1152, 8}));
  EXPECT_EQ(v.sizes(), (std::vector<int64_t>{2, 10, 16}));
  EXPECT_THROW(layer(torch::rand({2, 1151, 8})), c10::Error);
  EXPECT_THROW(layer(torch::rand({2, 1152, 16})), c10::Error);
  EXPECT_THROW(layer(torch::rand({1152, 8})), c10::Error);
  EXPECT_THROW(cn::CapsuleLinear(cn::CapsuleLinearOptions(4, 8, 10, 16).routing({0})), std::invalid_argument);
  EXPECT_THROW(cn::CapsuleLinear(cn::CapsuleLinearOptions(4, 0, 10, 16)), c10::Error);
}

TEST(LayersTest, DecoderShapeAndRange) {
  torch::manual_seed(14);
  cn::Decoder decoder(cn::DecoderOptions(160, 784));
  EXPECT_EQ(decoder->fc1->weight.sizes(), (std::vector<int64_t>{512, 160}));
  EXPECT_EQ(decoder->fc2->weight.sizes(), (std::vector<int64_t>{1024, 512}));
  EXPECT_EQ(decoder->fc3->weight.sizes(), (std::vector<int64_t>{784, 1024}));
  auto y = decoder(torch::randn({3, 160}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 784}));
  EXPECT_GT(y.min().item<float>(), 0.0f);
  EXPECT_LT(y.max().item<float>(), 1.0f);
  // Explicit FC-ReLU-FC-ReLU-FC-sigmoid.
  auto x = torch::randn({2, 160});
  auto h = torch::relu(torch::matmul(x, decoder->fc1->weight.t()) + decoder->fc1->bias);
  h = torch::relu(torch::matmul(h, decoder->fc2->weight.t()) + decoder->fc2->bias);
  auto expected = torch::sigmoid(torch::matmul(h, decoder->fc3->weight.t()) + decoder->fc3->bias);
  EXPECT_TRUE(torch::allclose(decoder(x), expected, 1e-5, 1e-6));
}

TEST(LayersTest, GradcheckPrimaryCaps) {
  torch::manual_seed(15);
  cn::PrimaryCaps pc(cn::PrimaryCapsOptions(2, 2, 3).kernel_size(3).stride(2));
  pc->to(torch::kDouble);
  auto x = torch::randn({2, 2, 7, 7}, torch::kDouble).set_requires_grad(true);
  auto inputs = parameters_of(*pc);
  inputs.insert(inputs.begin(), x);
  GradcheckOptions o;
  o.max_elements = 40;
  EXPECT_TRUE(gradcheck([&](const std::vector<torch::Tensor>& in) { return pc(in[0]); }, inputs, o));
  // With an output scale (the authors' 1/types).
  cn::PrimaryCaps scaled(cn::PrimaryCapsOptions(2, 2, 3).kernel_size(3).stride(2).output_scale(0.5));
  scaled->to(torch::kDouble);
  auto scaled_inputs = parameters_of(*scaled);
  scaled_inputs.insert(scaled_inputs.begin(), x);
  EXPECT_TRUE(gradcheck([&](const std::vector<torch::Tensor>& in) { return scaled(in[0]); }, scaled_inputs, o));
}

// Coupling coefficients c_ij of the last iteration of Procedure 1, from detached predictions.
// u_hat: [B, I, J, D] -> c: [B, I, J].
torch::Tensor final_coupling(const torch::Tensor& u_hat, int64_t iterations) {
  auto u = u_hat.detach();
  auto b = torch::zeros({u.size(0), u.size(1), u.size(2)}, u.options());
  torch::Tensor c;
  for (int64_t t = 0; t < iterations; ++t) {
    c = torch::softmax(b, 2);
    if (t + 1 == iterations) break;
    auto v = capsnet::squash((c.unsqueeze(-1) * u).sum(1));
    b = b + (u * v.unsqueeze(1)).sum(-1);
  }
  return c;
}

TEST(LayersTest, GradcheckCapsuleLinear) {
  for (bool grad_through : {true, false})
    for (int64_t r : {1, 3}) {
      torch::manual_seed(16 + r);
      cn::CapsuleLinear layer(
          cn::CapsuleLinearOptions(4, 3, 3, 2).routing({r, grad_through}).weight_std(0.7));
      layer->to(torch::kDouble);
      auto u = torch::randn({2, 4, 3}, torch::kDouble).set_requires_grad(true);
      if (grad_through) {
        EXPECT_TRUE(gradcheck([&](const std::vector<torch::Tensor>& in) { return layer(in[0]); }, {u, layer->weight}))
            << "r " << r;
      } else {
        // Stop-gradient: the gradient is that of squash(sum_i c_ij W_ij u_i) with c frozen at (u, W);
        // value of that function, gradient of the layer (see RoutingTest.GradcheckBothImplementationsBothModes).
        const auto c = final_coupling(layer->predictions(u), r).unsqueeze(-1);
        auto straight_through = [&](const std::vector<torch::Tensor>& in) {
          auto v = layer(in[0]);
          auto h = capsnet::squash((c * layer->predictions(in[0])).sum(1));
          return h.detach() + (v - v.detach());
        };
        EXPECT_TRUE(gradcheck(straight_through, {u, layer->weight})) << "stop-gradient r " << r;
      }
    }
}

TEST(LayersTest, GradcheckDecoder) {
  torch::manual_seed(18);
  cn::Decoder decoder(cn::DecoderOptions(6, 5).hidden1(7).hidden2(4));
  decoder->to(torch::kDouble);
  auto x = torch::randn({3, 6}, torch::kDouble).set_requires_grad(true);
  auto inputs = parameters_of(*decoder);
  inputs.insert(inputs.begin(), x);
  EXPECT_TRUE(gradcheck([&](const std::vector<torch::Tensor>& in) { return decoder(in[0]); }, inputs));
}

TEST(LayersTest, GradcheckLossesAndSquash) {
  torch::manual_seed(19);
  // Margin loss on lengths spread around m- and m+ (kinks are measure-zero for random values).
  auto lengths = (torch::rand({4, 5}, torch::kDouble) * 1.2).set_requires_grad(true);
  auto labels = torch::tensor({4, 0, 2, 2}, torch::kLong);
  EXPECT_TRUE(gradcheck([&](const auto& in) { return capsnet::margin_loss(in[0], labels); }, {lengths}));
  // Through capsule lengths, from capsule vectors.
  auto v = (torch::randn({4, 5, 3}, torch::kDouble) * 0.5).set_requires_grad(true);
  EXPECT_TRUE(gradcheck(
      [&](const auto& in) { return capsnet::margin_loss(capsnet::capsule_length(in[0]), labels); }, {v}));
  auto targets = torch::tensor({1, 0, 0, 1, 0, 0, 1, 1, 0, 0}, torch::kDouble).view({2, 5});
  auto lengths2 = torch::rand({2, 5}, torch::kDouble).set_requires_grad(true);
  EXPECT_TRUE(gradcheck([&](const auto& in) { return capsnet::margin_loss_multi(in[0], targets); }, {lengths2}));

  auto recon = torch::rand({3, 8}, torch::kDouble).set_requires_grad(true);
  auto image = torch::rand({3, 1, 2, 4}, torch::kDouble);
  EXPECT_TRUE(gradcheck([&](const auto& in) { return capsnet::reconstruction_loss(in[0], image); }, {recon}));

  // Squash: ordinary, tiny (|s|^2 ~ eps) and exactly zero capsules.
  auto s = torch::randn({4, 5}, torch::kDouble);
  s[1].mul_(1e-4);
  s[2].mul_(1e-6);
  s[3].zero_();
  s.set_requires_grad(true);
  EXPECT_TRUE(gradcheck([](const auto& in) { return capsnet::squash(in[0]); }, {s}));

  // mask is linear in v.
  auto vm = torch::randn({3, 4, 2}, torch::kDouble).set_requires_grad(true);
  auto index = torch::tensor({3, 0, 1}, torch::kLong);
  EXPECT_TRUE(gradcheck([&](const auto& in) { return capsnet::mask(in[0], index); }, {vm}));
}

}  // namespace

namespace {
// The fused operator (default) and the composite path (predictions + dynamic_routing) agree at the
// paper's size in float32, in values and in gradients w.r.t. input and weights, in both modes.
TEST(LayersFusedTest, FusedAndCompositePathsAgreeAtPaperSize) {
  for (bool grad_through : {true, false}) {
    torch::manual_seed(29);
    cn::CapsuleLinear fused(cn::CapsuleLinearOptions(1152, 8, 10, 16).routing({3, grad_through}));
    cn::CapsuleLinear composite(
        cn::CapsuleLinearOptions(1152, 8, 10, 16).routing({3, grad_through, false}));
    {
      torch::NoGradGuard g;
      composite->weight.copy_(fused->weight);
    }
    auto u = capsnet::squash(torch::randn({4, 1152, 8})).set_requires_grad(true);
    auto u2 = u.detach().clone().set_requires_grad(true);
    auto v1 = fused(u), v2 = composite(u2);
    EXPECT_TRUE(torch::allclose(v1, v2, 1e-5, 1e-6)) << (v1 - v2).abs().max().item<float>();
    auto g = torch::randn_like(v1);
    (v1 * g).sum().backward();
    (v2 * g).sum().backward();
    EXPECT_TRUE(torch::allclose(u.grad(), u2.grad(), 1e-4, 1e-6)) << (u.grad() - u2.grad()).abs().max().item<float>();
    EXPECT_TRUE(torch::allclose(fused->weight.grad(), composite->weight.grad(), 1e-4, 1e-6))
        << (fused->weight.grad() - composite->weight.grad()).abs().max().item<float>();
  }
}
}  // namespace
