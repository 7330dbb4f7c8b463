// The weight average (capsnet/train/weight_average.h) against the formula written out in float64, and the
// swap that lends its values to the model.
#include <gtest/gtest.h>

#include "capsnet/train/weight_average.h"

namespace capsnet {
namespace {

TEST(WeightAverageTest, DecayWarmsUpThenHoldsTheGivenValue) {
  EXPECT_DOUBLE_EQ(train::WeightAverage::decay_at(0.999, 1), 2.0 / 11.0);
  EXPECT_DOUBLE_EQ(train::WeightAverage::decay_at(0.999, 100), 101.0 / 110.0);
  EXPECT_DOUBLE_EQ(train::WeightAverage::decay_at(0.5, 100), 0.5);
  EXPECT_DOUBLE_EQ(train::WeightAverage::decay_at(0.999, 1000000), 0.999);
  torch::nn::Linear model(3, 2);
  EXPECT_THROW(train::WeightAverage(*model, 1.0), std::invalid_argument);
  EXPECT_THROW(train::WeightAverage(*model, 0.0), std::invalid_argument);
}

TEST(WeightAverageTest, UpdatesFollowTheFormulaAndTheSwapLendsTheAverage) {
  torch::manual_seed(0);
  torch::nn::Linear model(3, 2);
  train::WeightAverage average(*model, 0.9);
  // The formula in float64, over a sequence of "optimizer steps" that set the weights.
  std::vector<torch::Tensor> expected;
  for (const auto& p : model->parameters()) expected.push_back(p.detach().to(torch::kFloat64));
  for (int64_t t = 1; t <= 30; ++t) {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.add_(torch::randn_like(p));
    }
    average.update(t);
    const double d = std::min(0.9, (1.0 + t) / (10.0 + t));
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i)
      expected[i] = d * expected[i] + (1 - d) * params[i].detach().to(torch::kFloat64);
  }
  ASSERT_EQ(average.tensors().size(), 2u);
  EXPECT_EQ(average.tensors()[0].first, "p0");
  for (size_t i = 0; i < expected.size(); ++i)
    EXPECT_TRUE(torch::allclose(average.tensors()[i].second.to(torch::kFloat64), expected[i], 1e-6, 1e-6)) << i;

  const auto trained = model->weight.detach().clone();
  const auto version = model->weight._version();
  {
    train::WeightAverage::Swap swap(average);
    EXPECT_TRUE(torch::equal(model->weight, average.tensors()[0].second));
    EXPECT_GT(model->weight._version(), version) << "caches keyed on the version must see the change";
    EXPECT_TRUE(model->weight.requires_grad());
  }
  EXPECT_TRUE(torch::equal(model->weight, trained)) << "the trained weights are back, bit for bit";
}

}  // namespace
}  // namespace capsnet
