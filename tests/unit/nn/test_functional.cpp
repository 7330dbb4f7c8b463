// Unit tests of the capsule math in capsnet/nn/functional.h: values computed by hand,
// numerical safety at zero, shape errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "capsnet/nn/functional.h"
#include "gradcheck.h"

namespace {

using capsnet::testing::gradcheck;

torch::Tensor f64(std::initializer_list<double> values) { return torch::tensor(std::vector<double>(values), torch::kDouble); }

TEST(FunctionalTest, SquashByHand) {
  // s = (3, 4): |s|^2 = 25, |s| = 5 -> v = 25/26 * (0.6, 0.8).
  auto v = capsnet::squash(f64({3.0, 4.0}));
  ASSERT_EQ(v.sizes(), (std::vector<int64_t>{2}));
  EXPECT_NEAR(v[0].item<double>(), 25.0 / 26.0 * 0.6, 1e-6);
  EXPECT_NEAR(v[1].item<double>(), 25.0 / 26.0 * 0.8, 1e-6);

  // A batch [2, 3] along the last dim: s = (1, 0, 0) -> |v| = 1/2; s = (0, 2, 0) -> |v| = 4/5.
  auto batch = capsnet::squash(torch::tensor({1.0, 0.0, 0.0, 0.0, 2.0, 0.0}, torch::kDouble).view({2, 3}));
  auto expected = torch::tensor({0.5, 0.0, 0.0, 0.0, 0.8, 0.0}, torch::kDouble).view({2, 3});
  EXPECT_TRUE(torch::allclose(batch, expected, 0, 1e-7)) << batch;

  // float32 gives the same numbers.
  auto v32 = capsnet::squash(torch::tensor({3.0f, 4.0f}));
  EXPECT_EQ(v32.scalar_type(), torch::kFloat);
  EXPECT_NEAR(v32[1].item<float>(), 25.0 / 26.0 * 0.8, 1e-6);
}

TEST(FunctionalTest, SquashAlongOtherDim) {
  torch::manual_seed(1);
  auto s = torch::randn({4, 3, 5}, torch::kDouble);
  // Capsule axis 1 equals moving that axis last, squashing, and moving it back.
  auto v = capsnet::squash(s, /*dim=*/1);
  auto expected = capsnet::squash(s.transpose(1, 2)).transpose(1, 2);
  EXPECT_TRUE(torch::allclose(v, expected, 1e-12, 1e-14));
  // And it is not the same as squashing along the last axis.
  EXPECT_FALSE(torch::allclose(v, capsnet::squash(s), 1e-3, 1e-3));
}

TEST(FunctionalTest, SquashOfZeroIsZeroWithZeroGradient) {
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    auto s = torch::zeros({2, 4}, torch::TensorOptions().dtype(dtype).requires_grad(true));
    auto v = capsnet::squash(s);
    EXPECT_TRUE(torch::equal(v.detach(), torch::zeros_like(v))) << v;
    auto r = torch::randn({2, 4}, torch::TensorOptions().dtype(dtype));
    (v * r).sum().backward();
    ASSERT_TRUE(s.grad().defined());
    EXPECT_TRUE(torch::isfinite(s.grad()).all().item<bool>()) << s.grad();
    EXPECT_TRUE(torch::equal(s.grad(), torch::zeros_like(s))) << s.grad();
  }
}

TEST(FunctionalTest, SquashLengthBelowOneAndMonotone) {
  // |v| = |s|^2 / (1 + |s|^2) (up to eps): strictly increasing in |s| and below 1.
  torch::manual_seed(2);
  auto direction = torch::randn({7}, torch::kDouble);
  direction = direction / direction.norm();
  double previous = -1;
  for (double scale : {1e-3, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 100.0, 1000.0}) {
    const double length = capsnet::squash(direction * scale).norm().item<double>();
    EXPECT_LT(length, 1.0) << "scale " << scale;
    EXPECT_GT(length, previous) << "scale " << scale;
    EXPECT_NEAR(length, scale * scale / (1 + scale * scale), 1e-8) << "scale " << scale;
    previous = length;
  }
}

TEST(FunctionalTest, SquashPreservesDirection) {
  torch::manual_seed(3);
  auto s = torch::randn({6, 10, 16}, torch::kDouble) * 3;
  auto v = capsnet::squash(s);
  auto cosine = (v * s).sum(-1) / (v.norm(2, -1) * s.norm(2, -1));
  EXPECT_TRUE(torch::allclose(cosine, torch::ones_like(cosine), 0, 1e-12)) << cosine;
  // v is a positive multiple of s: v / s is constant along the capsule axis.
  auto ratio = v / s;
  EXPECT_TRUE((ratio > 0).all().item<bool>());
  EXPECT_TRUE(torch::allclose(ratio, ratio.select(-1, 0).unsqueeze(-1).expand_as(ratio), 1e-12, 0));
}

TEST(FunctionalTest, SquashGradcheckIncludingNearZero) {
  torch::manual_seed(4);
  auto s = torch::randn({3, 4}, torch::kDouble);
  s[1].mul_(1e-4);  // |s|^2 ~ eps: the regime where the epsilon matters
  s[2].mul_(1e-2);
  s.set_requires_grad(true);
  EXPECT_TRUE(gradcheck([](const auto& in) { return capsnet::squash(in[0]); }, {s}));
  auto s_dim0 = (torch::randn({5, 2}, torch::kDouble) * 2).set_requires_grad(true);
  EXPECT_TRUE(gradcheck([](const auto& in) { return capsnet::squash(in[0], 0); }, {s_dim0}));
}

TEST(FunctionalTest, CapsuleLength) {
  auto v = torch::tensor({3.0, 4.0, 0.0, 1.0, 0.0, 0.0}, torch::kDouble).view({1, 2, 3});
  auto length = capsnet::capsule_length(v);
  ASSERT_EQ(length.sizes(), (std::vector<int64_t>{1, 2}));
  EXPECT_NEAR(length[0][0].item<double>(), 5.0, 1e-8);
  EXPECT_NEAR(length[0][1].item<double>(), 1.0, 1e-8);
  // Along another dim: [D, J] with dim 0.
  auto length0 = capsnet::capsule_length(v[0].t(), 0);
  EXPECT_TRUE(torch::allclose(length0, length[0], 0, 1e-12));
  // Finite gradient at zero.
  auto zero = torch::zeros({2, 3}, torch::TensorOptions().dtype(torch::kDouble).requires_grad(true));
  capsnet::capsule_length(zero).sum().backward();
  EXPECT_TRUE(torch::isfinite(zero.grad()).all().item<bool>());
}

TEST(FunctionalTest, MarginLossByHand) {
  // lengths = [[0.95, 0.30, 0.05],     labels = [0, 2], m+ = 0.9, m- = 0.1, lambda = 0.5
  //            [0.50, 0.20, 0.80]]
  // example 0: k=0 present: max(0, 0.9 - 0.95)^2 = 0
  //            k=1 absent : 0.5 * max(0, 0.30 - 0.1)^2 = 0.5 * 0.04 = 0.02
  //            k=2 absent : 0.5 * max(0, 0.05 - 0.1)^2 = 0            -> 0.02
  // example 1: k=0 absent : 0.5 * (0.5 - 0.1)^2 = 0.08
  //            k=1 absent : 0.5 * (0.2 - 0.1)^2 = 0.005
  //            k=2 present: (0.9 - 0.8)^2 = 0.01                     -> 0.095
  // batch mean: (0.02 + 0.095) / 2 = 0.0575
  auto lengths = torch::tensor({0.95, 0.30, 0.05, 0.50, 0.20, 0.80}, torch::kDouble).view({2, 3});
  auto labels = torch::tensor({0, 2}, torch::kLong);
  auto loss = capsnet::margin_loss(lengths, labels);
  EXPECT_EQ(loss.dim(), 0);
  EXPECT_NEAR(loss.item<double>(), 0.0575, 1e-12);

  // Each example alone: the batch reduction is a mean, not a sum.
  EXPECT_NEAR(capsnet::margin_loss(lengths.slice(0, 0, 1), labels.slice(0, 0, 1)).item<double>(), 0.02, 1e-12);
  EXPECT_NEAR(capsnet::margin_loss(lengths.slice(0, 1, 2), labels.slice(0, 1, 2)).item<double>(), 0.095, 1e-12);

  // Other options, m+ = 0.8, m- = 0.2, lambda = 1:
  // example 0: 0 + (0.3 - 0.2)^2 + 0 = 0.01; example 1: (0.5 - 0.2)^2 + 0 + max(0, 0.8 - 0.8)^2 = 0.09
  // mean: 0.05
  capsnet::MarginLossOptions o;
  o.m_plus = 0.8;
  o.m_minus = 0.2;
  o.lambda = 1.0;
  EXPECT_NEAR(capsnet::margin_loss(lengths, labels, o).item<double>(), 0.05, 1e-12);

  // int32 labels and float32 lengths work too.
  auto loss32 = capsnet::margin_loss(lengths.to(torch::kFloat), labels.to(torch::kInt));
  EXPECT_EQ(loss32.scalar_type(), torch::kFloat);
  EXPECT_NEAR(loss32.item<float>(), 0.0575, 1e-6);
}

TEST(FunctionalTest, MarginLossGradient) {
  // d/d|v_k|: present -2 (m+ - |v|) when |v| < m+, absent 2 lambda (|v| - m-) when |v| > m-; / B.
  auto lengths = torch::tensor({0.95, 0.30, 0.05, 0.50, 0.20, 0.80}, torch::kDouble).view({2, 3});
  lengths.set_requires_grad(true);
  capsnet::margin_loss(lengths, torch::tensor({0, 2}, torch::kLong)).backward();
  auto expected =
      torch::tensor({0.0, 2 * 0.5 * 0.2, 0.0, 2 * 0.5 * 0.4, 2 * 0.5 * 0.1, -2 * 0.1}, torch::kDouble).view({2, 3}) /
      2;
  EXPECT_TRUE(torch::allclose(lengths.grad(), expected, 0, 1e-12)) << lengths.grad();

  torch::manual_seed(5);
  auto random_lengths = torch::rand({3, 4}, torch::kDouble).set_requires_grad(true);
  auto labels = torch::tensor({1, 3, 0}, torch::kLong);
  EXPECT_TRUE(gradcheck([&](const auto& in) { return capsnet::margin_loss(in[0], labels); }, {random_lengths}));
}

TEST(FunctionalTest, MarginLossMultiEqualsMarginLossForOneHot) {
  torch::manual_seed(6);
  auto lengths = torch::rand({5, 10}, torch::kDouble);
  auto labels = torch::tensor({3, 0, 9, 3, 7}, torch::kLong);
  auto one_hot = torch::one_hot(labels, 10);
  EXPECT_NEAR(capsnet::margin_loss_multi(lengths, one_hot).item<double>(),
              capsnet::margin_loss(lengths, labels).item<double>(), 1e-14);
  EXPECT_NEAR(capsnet::margin_loss_multi(lengths, one_hot.to(torch::kFloat)).item<double>(),
              capsnet::margin_loss(lengths, labels).item<double>(), 1e-14);

  // Two-hot, by hand: lengths [0.5, 0.95, 0.3], targets [1, 1, 0]
  // (0.9 - 0.5)^2 + 0 + 0.5 (0.3 - 0.1)^2 = 0.16 + 0.02 = 0.18
  auto l = torch::tensor({0.5, 0.95, 0.3}, torch::kDouble).view({1, 3});
  auto t = torch::tensor({1, 1, 0}, torch::kLong).view({1, 3});
  EXPECT_NEAR(capsnet::margin_loss_multi(l, t).item<double>(), 0.18, 1e-12);
}

TEST(FunctionalTest, MaskKeepsOnlyTheChosenCapsule) {
  torch::manual_seed(7);
  auto v = torch::randn({3, 4, 5}, torch::kDouble);
  auto index = torch::tensor({2, 0, 3}, torch::kLong);
  auto m = capsnet::mask(v, index);
  ASSERT_EQ(m.sizes(), (std::vector<int64_t>{3, 20}));
  auto m3 = m.view({3, 4, 5});
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t j = 0; j < 4; ++j) {
      if (j == index[b].item<int64_t>())
        EXPECT_TRUE(torch::equal(m3[b][j], v[b][j])) << "b " << b << " j " << j;
      else
        EXPECT_TRUE(torch::equal(m3[b][j], torch::zeros({5}, torch::kDouble))) << "b " << b << " j " << j;
    }
  }
  // Gradient reaches only the kept capsule.
  auto vg = v.clone().set_requires_grad(true);
  capsnet::mask(vg, index).sum().backward();
  EXPECT_TRUE(torch::equal(vg.grad(), torch::one_hot(index, 4).to(torch::kDouble).unsqueeze(-1).expand({3, 4, 5})));
}

TEST(FunctionalTest, ReconstructionLossByHand) {
  // reconstruction [2, 4]; target [2, 1, 2, 2] (an image batch), flattened per example:
  // example 0: (0-0)^2 + (0.5-0)^2 + (1-1)^2 + (0.25-1)^2 = 0.25 + 0.5625 = 0.8125
  // example 1: (1-0.5)^2 + (1-1)^2 + (0-0)^2 + (0-1)^2    = 0.25 + 1      = 1.25
  // mean 1.03125; scaled by 0.0005: 5.15625e-4
  auto recon = torch::tensor({0.0, 0.5, 1.0, 0.25, 1.0, 1.0, 0.0, 0.0}, torch::kDouble).view({2, 4});
  auto target = torch::tensor({0.0, 0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 1.0}, torch::kDouble).view({2, 1, 2, 2});
  EXPECT_NEAR(capsnet::reconstruction_loss(recon, target).item<double>(), 5.15625e-4, 1e-15);
  EXPECT_NEAR(capsnet::reconstruction_loss(recon, target, 1.0).item<double>(), 1.03125, 1e-12);
  // A float32 target with a float64 reconstruction.
  EXPECT_NEAR(capsnet::reconstruction_loss(recon, target.to(torch::kFloat), 1.0).item<double>(), 1.03125, 1e-7);

  torch::manual_seed(8);
  auto r = torch::rand({2, 6}, torch::kDouble).set_requires_grad(true);
  auto t = torch::rand({2, 2, 3}, torch::kDouble).set_requires_grad(true);
  EXPECT_TRUE(gradcheck([](const auto& in) { return capsnet::reconstruction_loss(in[0], in[1]); }, {r, t}));
}

TEST(FunctionalTest, BadShapesThrow) {
  auto lengths = torch::rand({2, 3});
  auto labels = torch::tensor({0, 1}, torch::kLong);
  EXPECT_THROW(capsnet::margin_loss(lengths.view({6}), labels), c10::Error);             // lengths not [B, K]
  EXPECT_THROW(capsnet::margin_loss(lengths, torch::tensor({0, 1, 2}, torch::kLong)), c10::Error);  // B mismatch
  EXPECT_THROW(capsnet::margin_loss(lengths, labels.view({2, 1})), c10::Error);           // labels not [B]
  EXPECT_THROW(capsnet::margin_loss(lengths, torch::tensor({0, 3}, torch::kLong)), c10::Error);   // class >= K
  EXPECT_THROW(capsnet::margin_loss(lengths, torch::tensor({-1, 0}, torch::kLong)), c10::Error);  // class < 0
  EXPECT_THROW(capsnet::margin_loss_multi(lengths, torch::zeros({2, 4})), c10::Error);
  EXPECT_THROW(capsnet::margin_loss_multi(lengths.view({6}), torch::zeros({6})), c10::Error);

  auto v = torch::rand({2, 3, 4});
  EXPECT_THROW(capsnet::mask(v.view({2, 12}), labels), c10::Error);                      // v not [B, J, D]
  EXPECT_THROW(capsnet::mask(v, torch::tensor({0, 1, 2}, torch::kLong)), c10::Error);     // B mismatch
  EXPECT_THROW(capsnet::mask(v, torch::tensor({0, 3}, torch::kLong)), c10::Error);        // j >= J

  EXPECT_THROW(capsnet::reconstruction_loss(torch::rand({2, 4}), torch::rand({2, 5})), c10::Error);
  EXPECT_THROW(capsnet::reconstruction_loss(torch::rand({2, 4}), torch::rand({3, 4})), c10::Error);
  EXPECT_THROW(capsnet::reconstruction_loss(torch::rand({2, 4}), torch::rand({2, 1, 3, 3})), c10::Error);
  // The right shapes do not throw.
  EXPECT_NO_THROW(capsnet::reconstruction_loss(torch::rand({2, 4}), torch::rand({2, 1, 2, 2})));
}

TEST(FunctionalTest, GradcheckDetectsAWrongGradient) {
  // The checker itself must be able to fail: x * x.detach() has autograd gradient x, true gradient 2x.
  torch::manual_seed(9);
  auto x = (torch::rand({3}, torch::kDouble) + 0.5).set_requires_grad(true);
  auto wrong = gradcheck([](const auto& in) { return in[0] * in[0].detach(); }, {x});
  EXPECT_FALSE(wrong);
  EXPECT_NE(std::string(wrong.message()).find("input 0 element [0]"), std::string::npos) << wrong.message();
  EXPECT_TRUE(gradcheck([](const auto& in) { return in[0] * in[0]; }, {x}));
  // Float32 inputs are refused rather than checked imprecisely.
  auto x32 = torch::rand({3}).set_requires_grad(true);
  EXPECT_FALSE(gradcheck([](const auto& in) { return in[0] * 2; }, {x32}));
}

}  // namespace
