// evaluate_ensemble against a direct computation: capsule lengths averaged over the models, argmax.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "capsnet/data/transforms.h"
#include "capsnet/train/evaluate.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

// Three tiny CapsNets of different random weights (seeds 1-3), untrained: their predictions disagree on
// many images, and the average is not any one model's answer (asserted below).
std::vector<models::CapsNet> three_models() {
  std::vector<models::CapsNet> models;
  for (int seed : {1, 2, 3}) {
    torch::manual_seed(seed);
    models.emplace_back(testing::tiny_config());
  }
  return models;
}

// The reference: every model on the whole set at once, lengths added, argmax; and each model's own argmax.
struct Reference {
  torch::Tensor prediction;               // [N]
  std::vector<torch::Tensor> per_model;   // [N] each
};
Reference reference(std::vector<models::CapsNet>& models, const data::ImageSet& set) {
  torch::NoGradGuard no_grad;
  const auto images = data::to_float(set.images);  // [N, 1, S, S]
  Reference r;
  torch::Tensor sum;
  for (auto& m : models) {
    m->eval();
    const auto lengths = m(images).lengths;  // [N, K]
    r.per_model.push_back(lengths.argmax(1));
    sum = sum.defined() ? sum + lengths : lengths;
  }
  r.prediction = sum.argmax(1);
  return r;
}

TEST(EnsembleTest, AveragesCapsuleLengthsAndScoresEachMemberOnTheSameImages) {
  auto models = three_models();
  const auto set = testing::synthetic_set(100, 12, 7);
  const auto ref = reference(models, set);
  ASSERT_FALSE(ref.per_model[0].equal(ref.per_model[1])) << "models 0 and 1 must disagree somewhere";
  for (const auto& alone : ref.per_model)
    ASSERT_FALSE(ref.prediction.equal(alone)) << "the average must differ from each model alone somewhere";
  models[1]->train();  // a member in training mode is evaluated in eval mode and left as it was

  const auto e = train::evaluate_ensemble(models, set, /*batch_size=*/16);  // 6 batches of 16 and one of 4
  EXPECT_TRUE(models[1]->is_training());
  EXPECT_FALSE(models[0]->is_training());
  EXPECT_EQ(e.ensemble.examples, 100);
  EXPECT_TRUE(std::isnan(e.ensemble.loss));
  const double expected = ref.prediction.eq(set.labels).sum().item<double>() / 100;
  EXPECT_DOUBLE_EQ(e.ensemble.accuracy, expected);
  auto confusion = torch::zeros({10, 10}, torch::kLong);
  confusion.index_put_({set.labels, ref.prediction}, torch::ones({100}, torch::kLong), true);
  EXPECT_TRUE(e.ensemble.confusion.equal(confusion)) << e.ensemble.confusion << "\n" << confusion;
  ASSERT_EQ(e.member_accuracy.size(), 3u);
  for (size_t m = 0; m < 3; ++m) {
    EXPECT_DOUBLE_EQ(e.member_accuracy[m], ref.per_model[m].eq(set.labels).sum().item<double>() / 100) << m;
    EXPECT_DOUBLE_EQ(e.member_accuracy[m], train::evaluate(models[m], set, 16).accuracy) << m;
  }
}

TEST(EnsembleTest, OneModelOrTheSameModelTwiceScoresAsTheModelAlone) {
  auto models = three_models();
  const auto set = testing::synthetic_set(40, 12, 3);
  const auto alone = train::evaluate(models[0], set, 8);
  for (const size_t copies : {1, 2}) {
    std::vector<models::CapsNet> same(copies, models[0]);
    const auto e = train::evaluate_ensemble(same, set, 8);
    EXPECT_DOUBLE_EQ(e.ensemble.accuracy, alone.accuracy) << copies;
    EXPECT_TRUE(e.ensemble.confusion.equal(alone.confusion)) << copies;
  }
}

TEST(EnsembleTest, RefusesNoModelsAndModelsOfOtherClassCounts) {
  const auto set = testing::synthetic_set(8, 12, 1);
  std::vector<models::CapsNet> none;
  EXPECT_THROW(train::evaluate_ensemble(none, set, 4), std::invalid_argument);
  auto models = three_models();
  auto five = testing::tiny_config();
  five.num_classes = 5;
  models.emplace_back(five);
  try {
    train::evaluate_ensemble(models, set, 4);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("model 3 has 5 classes, model 0 has 10"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace capsnet
