// The one classification Task (capsnet/train/classifier_task.h): its classifiers' losses and evaluations
// against the models' own, the loop's records of its evaluators, and its name and config check on resume.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/classifier_task.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace capsnet {
namespace {

using testing::TempDir;

std::vector<nlohmann::json> records(const std::string& path, const std::string& event) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == event) out.push_back(j);
  }
  return out;
}

// CapsNet's training loss carries its two terms (total = margin + scaled reconstruction, as the model's
// loss computes them) and the batch accuracy of the longest capsule; evaluate equals train::evaluate and
// predict the argmax of the lengths.
TEST(ClassifierTask, TheCapsNetClassifierIsTheModelsLossPredictionAndEvaluation) {
  torch::manual_seed(21);
  auto c = train::capsnet_classifier("capsnet", testing::tiny_config());
  const auto set = testing::synthetic_set(24, 12, 22);
  const auto images = data::to_float(set.images);  // [24, 1, 12, 12]
  auto l = c.loss(images, set.labels);
  ASSERT_EQ(l.scalars.size(), 3u);
  EXPECT_EQ(l.scalars[0].first, "margin_loss");
  EXPECT_EQ(l.scalars[1].first, "reconstruction_loss");
  EXPECT_EQ(l.scalars[2].first, "accuracy");
  EXPECT_EQ(l.total.item<float>(), (l.scalars[0].second + l.scalars[1].second).item<float>());
  EXPECT_GT(l.scalars[0].second.item<double>(), 0);
  EXPECT_GT(l.scalars[1].second.item<double>(), 0);  // the tiny config has a decoder
  auto* model = dynamic_cast<models::CapsNetImpl*>(c.module.get());
  ASSERT_NE(model, nullptr);
  {
    torch::NoGradGuard g;
    model->eval();
    auto lengths = model->forward(images).lengths;  // [24, 10]
    EXPECT_TRUE(torch::equal(c.predict(images), lengths.argmax(1)));
    const auto r = c.evaluate(set, 10, nullptr);
    EXPECT_EQ(r.examples, 24);
    EXPECT_DOUBLE_EQ(r.accuracy, lengths.argmax(1).eq(set.labels).to(torch::kFloat64).mean().item<double>());
    EXPECT_DOUBLE_EQ(train::classifier_accuracy(c, set, 7, nullptr, "test"), r.accuracy);
  }
}

// shifted_batches: the rows asked for, shifted, then with hflip mirrored, the flips drawn after the shifts from
// the same generator; without hflip nothing more is drawn (the batches of runs that predate it).
TEST(ClassifierTask, ShiftedBatchesShiftThenMirrorFromTheStepsGenerator) {
  const auto set = testing::synthetic_set(40, 12, 34);
  const auto ids = torch::tensor({3, 17, 5, 30, 8, 22, 11, 0}, torch::kLong);
  const auto rows = data::to_float(set.images.index_select(0, ids));
  for (const int64_t max_shift : {0, 2}) {
    auto g1 = at::make_generator<at::CPUGeneratorImpl>(21), g2 = at::make_generator<at::CPUGeneratorImpl>(21);
    const auto [plain, labels] = train::shifted_batches(set, max_shift)(ids, g1);
    EXPECT_TRUE(torch::equal(labels, set.labels.index_select(0, ids)));
    EXPECT_TRUE(torch::equal(plain, data::random_shift(rows, max_shift, g2)));
    auto g3 = at::make_generator<at::CPUGeneratorImpl>(21), g4 = at::make_generator<at::CPUGeneratorImpl>(21);
    const auto mirrored = train::shifted_batches(set, max_shift, /*hflip=*/true)(ids, g3).first;
    const auto shifted = data::random_shift(rows, max_shift, g4);
    EXPECT_TRUE(torch::equal(mirrored, data::random_hflip(shifted, g4))) << max_shift;
    EXPECT_FALSE(torch::equal(mirrored, shifted)) << max_shift;  // 8 images: some are mirrored
  }
}

// The task in the loop: the baseline CNN trained on shifted images; the loop records each evaluator's
// result as the classifier scores it after training (the loss evaluator's also in `last`), the task's
// name in its checkpoint, and a resume refuses another task name or another model config.
TEST(ClassifierTask, TheLoopRecordsItsEvaluatorsAndAResumeChecksNameAndConfig) {
  TempDir dir;
  const auto train_set = testing::synthetic_set(64, 12, 31);
  const auto val_set = testing::synthetic_set(20, 12, 32);
  const auto test_set = testing::synthetic_set(30, 12, 33);
  auto task_for = [&](const std::string& name, int64_t fc2_units, std::optional<train::EvalResult>* last) {
    auto config = testing::tiny_cnn_config(12);
    config.fc2_units = fc2_units;
    auto task = std::make_unique<train::ClassifierTask>(
        name, [config](Precision p) { return train::cnn_classifier("cnn", config, p); }, train_set.size(),
        /*shuffle=*/true, train::shifted_batches(train_set, 1), nlohmann::json{{"train_examples", train_set.size()}},
        train::loss_evaluator(test_set, "test", 8, last));
    task->set_validation(train::accuracy_evaluator(val_set, "val", "validation", 8));
    return task;
  };
  train::LoopOptions o;
  o.out_dir = dir / "run";
  o.batch_size = 16;
  o.epochs = 2;
  o.lr = 3e-3;
  o.seed = 5;
  o.progress = false;
  std::optional<train::EvalResult> last;
  auto task = task_for("cnn-run", 12, &last);
  std::ostringstream log;
  const auto r = train::run(*task, o, log);
  EXPECT_EQ(r.end_step, 8);
  EXPECT_NE(log.str().find("cnn: "), std::string::npos) << log.str();  // describe(): the classifier's name

  auto& c = task->classifier();
  const auto test = c.evaluate(test_set, 8, nullptr);  // the batch of the evaluator: the same sums
  ASSERT_TRUE(last.has_value());
  EXPECT_DOUBLE_EQ(last->accuracy, test.accuracy);
  EXPECT_DOUBLE_EQ(last->loss, test.loss);
  const auto metrics = o.out_dir + "/metrics.jsonl";
  const auto evals = records(metrics, "eval");
  ASSERT_EQ(evals.size(), 4u);  // val and test at each epoch end
  EXPECT_EQ(evals[2]["split"], "val");
  EXPECT_DOUBLE_EQ(evals[2]["accuracy"].get<double>(), train::classifier_accuracy(c, val_set, 3, nullptr, "val"));
  EXPECT_EQ(evals[3]["split"], "test");
  EXPECT_DOUBLE_EQ(evals[3]["accuracy"].get<double>(), test.accuracy);
  EXPECT_DOUBLE_EQ(evals[3]["loss"].get<double>(), test.loss);
  EXPECT_NEAR(evals[3]["error"].get<double>(), 1 - test.accuracy, 1e-15);
  EXPECT_EQ(records(metrics, "start").at(0)["train"]["task"], "cnn-run");
  EXPECT_EQ(train::read_checkpoint_meta(o.out_dir + "/checkpoint.pt").train_options["task"], "cnn-run");

  o.resume = o.out_dir + "/checkpoint.pt";
  o.epochs = 3;
  auto renamed = task_for("other-run", 12, nullptr);
  EXPECT_THROW(train::run(*renamed, o, log), std::invalid_argument);
  auto wider = task_for("cnn-run", 13, nullptr);
  EXPECT_THROW(train::run(*wider, o, log), train::CheckpointError);
  auto same = task_for("cnn-run", 12, nullptr);
  EXPECT_EQ(train::run(*same, o, log).end_step, 12);
}

}  // namespace
}  // namespace capsnet
