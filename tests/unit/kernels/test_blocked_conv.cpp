// kernels/blocked_conv.h: inference convolutions on oneDNN's blocked tensors compute what the plain
// convolution computes, reorder their weights once per weight update (not per call, and again after
// an optimizer step or a load), stay out of autograd, and a CapsNet's inference forward equals its
// training-mode forward in both precisions.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "capsnet/models/capsnet.h"
#include "capsnet/kernels/blocked_conv.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "test_helpers.h"
#include "precisions.h"

namespace capsnet {
namespace {


double max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max() / b.abs().max().clamp_min(1e-12))
      .item<double>();
}

TEST(BlockedConv, MatchesThePlainConvolutionInEveryPrecision) {
  torch::manual_seed(1);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(6, 10, 5).stride(2).dilation(1));
  const auto x = torch::rand({3, 6, 17, 15});
  for (const auto precision : testing::cpu_precisions()) {
    kernels::BlockedConvWeights blocked;
    torch::NoGradGuard no_grad;
    const auto plain = kernels::conv2d_at(conv, x, precision);
    const auto y = kernels::conv2d_at(conv, x, precision, &blocked);
    ASSERT_TRUE(y.is_mkldnn());
    EXPECT_EQ(y.scalar_type(), compute_dtype(precision));
    EXPECT_EQ(y.sizes(), plain.sizes());
    // The same oneDNN kernels: equal up to the order of a few additions.
    EXPECT_LT(max_rel(y.to_dense(), plain), precision == Precision::kFloat32 ? 1e-5 : 1e-2)
        << precision_name(precision);
  }
}

TEST(BlockedConv, WeightsAreReorderedOncePerUpdate) {
  torch::manual_seed(2);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(4, 8, 3));
  const auto x = torch::rand({2, 4, 9, 9});
  kernels::BlockedConvWeights blocked;
  const auto infer = [&] {
    torch::NoGradGuard no_grad;
    return kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked).to_dense();
  };
  const auto first = infer();
  infer();
  infer();
  EXPECT_EQ(blocked.reorders(), 1);

  // An optimizer step changes the weights in place: the next call must see the new ones.
  torch::optim::Adam adam(conv->parameters(), torch::optim::AdamOptions(0.1));
  conv->forward(x).square().sum().backward();
  adam.step();
  const auto after_step = infer();
  EXPECT_EQ(blocked.reorders(), 2);
  EXPECT_GT((after_step - first).abs().max().item<double>(), 1e-3);
  EXPECT_LT(max_rel(after_step, conv->forward(x).detach()), 1e-5);

  // So does a load (an in-place copy under NoGradGuard), and a bias-only change.
  {
    torch::NoGradGuard no_grad;
    conv->weight.copy_(torch::randn_like(conv->weight));
  }
  EXPECT_LT(max_rel(infer(), conv->forward(x).detach()), 1e-5);
  {
    torch::NoGradGuard no_grad;
    conv->bias.add_(1.0);
  }
  EXPECT_LT(max_rel(infer(), conv->forward(x).detach()), 1e-5);
  EXPECT_EQ(blocked.reorders(), 4);

  // LibTorch 1.13's SGD updates p.data(), which bumps no version counter: the training forward before
  // the step (autograd on) drops the kept weights, so the next inference call still sees the new ones.
  torch::optim::SGD sgd(conv->parameters(), torch::optim::SGDOptions(0.1));
  const auto before_sgd = infer();
  kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked).square().sum().backward();
  sgd.step();
  const auto after_sgd = infer();
  EXPECT_GT((after_sgd - before_sgd).abs().max().item<double>(), 1e-3);
  EXPECT_LT(max_rel(after_sgd, conv->forward(x).detach()), 1e-5);
  EXPECT_EQ(blocked.reorders(), 5);

  // A bias replaced by another tensor whose version counter happens to equal the old one's: the kept
  // bias is the old storage's, so the next call must make it again (the weight's check, for the bias).
  {
    torch::NoGradGuard no_grad;
    auto replacement = torch::randn_like(conv->bias);
    while (replacement._version() < conv->bias._version()) replacement.add_(0.0);
    ASSERT_EQ(replacement._version(), conv->bias._version());
    conv->bias.set_data(replacement);
  }
  EXPECT_LT(max_rel(infer(), conv->forward(x).detach()), 1e-5);
  EXPECT_EQ(blocked.reorders(), 6);
}

TEST(BlockedConv, AutogradKeepsThePlainPath) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 3));
  kernels::BlockedConvWeights blocked;
  const auto y = kernels::conv2d_at(conv, torch::rand({1, 2, 5, 5}), Precision::kFloat32, &blocked);
  EXPECT_FALSE(y.is_mkldnn());
  EXPECT_TRUE(y.requires_grad());
  EXPECT_EQ(blocked.reorders(), 0);
  // A blocked input reaching a convolution that cannot run blocked is made dense, not refused.
  torch::Tensor xb;
  {
    torch::NoGradGuard no_grad;
    xb = torch::rand({1, 2, 5, 5}).to_mkldnn();
  }
  EXPECT_FALSE(kernels::conv2d_at(conv, xb, Precision::kFloat32, &blocked).is_mkldnn());
}

// Finite differences run the model under NoGradGuard: a float64 model must stay float64 there.
TEST(BlockedConv, Float64ModelsKeepThePlainPath) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 3));
  conv->to(torch::kDouble);
  kernels::BlockedConvWeights blocked;
  const auto x = torch::rand({1, 2, 5, 5}, torch::kDouble);
  torch::NoGradGuard no_grad;
  const auto y = kernels::conv2d_at(conv, x, Precision::kFloat32, &blocked);
  EXPECT_FALSE(y.is_mkldnn());
  EXPECT_EQ(y.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(y, conv->forward(x)));
  EXPECT_EQ(blocked.reorders(), 0);
}

TEST(BlockedConv, ACloneStartsWithoutTheOriginalsWeights) {
  nn::PrimaryCaps caps(nn::PrimaryCapsOptions(4, 2, 4).kernel_size(3));
  {
    torch::NoGradGuard no_grad;
    caps(torch::rand({1, 4, 9, 9}));
  }
  EXPECT_EQ(caps->blocked_conv.reorders(), 1);
  const auto clone = std::dynamic_pointer_cast<nn::PrimaryCapsImpl>(caps->clone());
  EXPECT_EQ(clone->blocked_conv.reorders(), 0);
  {
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(clone->conv->weight);
  }
  torch::NoGradGuard no_grad;
  const auto x = torch::rand({2, 4, 9, 9});
  EXPECT_GT((clone->forward(x) - caps(x)).abs().max().item<double>(), 1e-3);
}

TEST(BlockedConv, CapsNetInferenceEqualsItsTrainingModeForward) {
  torch::manual_seed(3);
  models::CapsNet model(testing::tiny_config());
  const auto images = torch::rand({5, 1, 12, 12});
  for (const auto precision : testing::cpu_precisions()) {
    model->set_precision(precision);
    const auto reference = model(images);  // autograd on: the plain path
    torch::NoGradGuard no_grad;
    const auto inference = model(images);
    const double tolerance = precision == Precision::kFloat32 ? 1e-5 : 2e-2;
    EXPECT_LT(max_rel(inference.digit_caps, reference.digit_caps.detach()), tolerance)
        << precision_name(precision);
    EXPECT_LT(max_rel(inference.reconstruction, reference.reconstruction.detach()), tolerance);
    EXPECT_EQ(inference.digit_caps.scalar_type(), torch::kFloat32);
  }
}

}  // namespace
}  // namespace capsnet
