// The one training loop (capsnet/train/loop.h) on a task small enough to reason about exactly:
// linear regression, whose batches record which examples the loop asked for.
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "capsnet/kernels/adam_state.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/gradients.h"
#include "capsnet/train/loop.h"
#include "loop_options.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::TempDir;

/// y = x . w_true + 0.5 on n examples of 3 features; the model is one Linear(3, 1).
class RegressionTask : public train::Task {
 public:
  RegressionTask(int64_t n, bool shuffle) : n_(n), shuffle_(shuffle) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    x_ = torch::randn({n, 3}, gen);
    y_ = x_.matmul(torch::tensor({1.0f, -2.0f, 0.5f})) + 0.5;  // [n]
  }
  std::string name() const override { return "regression"; }
  std::shared_ptr<torch::nn::Module> build_model(Precision) override {
    model_ = torch::nn::Linear(3, 1);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return {{"in", 3}, {"out", 1}}; }
  nlohmann::json data_config() const override { return {{"examples", n_}}; }
  std::string describe() const override { return "Linear(3, 1)"; }
  int64_t epoch_size() const override { return n_; }
  bool shuffle() const override { return shuffle_; }
  train::Batch batch(const torch::Tensor& ids, at::Generator&) const override {
    seen.push_back(ids.clone());
    auto rows = ids.remainder(n_);  // a stream's ids run past n: wrap onto the data
    return {{x_.index_select(0, rows), y_.index_select(0, rows)}};
  }
  train::TaskLoss loss(const train::Batch& rows) override {
    ++steps;
    if (nan_at_step >= 0 && steps - 1 == nan_at_step)
      return {torch::full({}, std::numeric_limits<float>::quiet_NaN(), torch::requires_grad()), {}};
    auto err = model_(rows[0]).squeeze(1) - rows[1];
    auto close = err.detach().abs().lt(0.5).to(torch::kFloat64).mean();
    return {err.pow(2).mean(), {{"accuracy", close}}};
  }
  std::optional<train::Evaluation> evaluate(std::ostream*) override {
    ++evaluations;
    torch::NoGradGuard no_grad;
    const double mse = (model_(x_).squeeze(1) - y_).pow(2).mean().item<double>();
    last_mse = mse;
    return train::Evaluation{{{"mse", mse}}, "mse"};
  }

  mutable std::vector<torch::Tensor> seen;  // ids of every batch asked for
  int64_t steps = 0, evaluations = 0, nan_at_step = -1;
  double last_mse = 0;  // of the last evaluation
  torch::nn::Linear model_{nullptr};

 private:
  int64_t n_;
  bool shuffle_;
  torch::Tensor x_, y_;
};

train::LoopOptions options(const std::string& out_dir) {
  auto o = testing::quiet_loop(out_dir, 4);
  o.lr = 0.05;
  o.lr_decay = 0.5;
  o.seed = 3;
  o.log_every = 1;
  return o;
}

std::vector<nlohmann::json> records(const std::string& out_dir, const std::string& event) {
  std::ifstream in(train::metrics_path(out_dir));
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == event) out.push_back(j);
  }
  return out;
}

TEST(LoopTest, ClearGradsLetsAdamLeaveAParameterTheLossMissedWhereItIs) {
  // The loop releases the gradients before each backward (train::clear_grads): a parameter the loss
  // does not reach then has none, and Adam skips it; a zeroed gradient would move it through its moments.
  auto a = torch::ones({3}, torch::requires_grad()), b = torch::ones({3}, torch::requires_grad());
  torch::optim::Adam adam(std::vector<torch::Tensor>{a, b}, torch::optim::AdamOptions(0.1));
  (a.sum() + b.sum()).backward();
  adam.step();
  train::clear_grads(adam);
  EXPECT_FALSE(a.grad().defined());
  EXPECT_FALSE(b.grad().defined());
  const auto a_before = a.detach().clone(), b_before = b.detach().clone();
  (a * a).sum().backward();
  adam.step();
  EXPECT_FALSE(torch::equal(a.detach(), a_before));
  EXPECT_TRUE(torch::equal(b.detach(), b_before));
  // The contrast: a zeroed (defined) gradient moves b through Adam's first moment.
  train::clear_grads(adam);
  (a * a).sum().backward();
  b.mutable_grad() = torch::zeros_like(b);
  adam.step();
  EXPECT_FALSE(torch::equal(b.detach(), b_before));
}

TEST(LoopTest, AdamStateAllocatedBeforeTheFirstStepChangesNoNumber) {
  // kernels::allocate_adam_state gives Adam the state it would create lazily; the updates must be the same
  // to the bit, a parameter the loss misses must stay put, and a restored state must be kept.
  auto make = [] {
    torch::manual_seed(3);
    return std::vector<torch::Tensor>{torch::randn({4, 5}).requires_grad_(), torch::randn({5}).requires_grad_(),
                                      torch::randn({2}).requires_grad_()};
  };
  auto lazy = make(), eager = make();
  for (const bool amsgrad : {false, true}) {
    auto options = torch::optim::AdamOptions(0.05).weight_decay(0.01).amsgrad(amsgrad);
    torch::optim::Adam lazy_adam(lazy, options), eager_adam(eager, options);
    kernels::allocate_adam_state(eager_adam);
    EXPECT_EQ(eager_adam.state().size(), 3u);
    EXPECT_EQ(lazy_adam.state().size(), 0u);
    const auto missed_before = eager[2].detach().clone();
    for (int step = 0; step < 4; ++step) {
      for (auto* params : {&lazy, &eager}) {
        train::clear_grads(*params);
        auto x = torch::linspace(-1, 1, 4) + step;
        ((*params)[0].t().matmul(x) + (*params)[1]).pow(2).sum().backward();  // never reaches params[2]
      }
      lazy_adam.step();
      eager_adam.step();
      for (int i = 0; i < 3; ++i)
        EXPECT_TRUE(torch::equal(lazy[i].detach(), eager[i].detach())) << "amsgrad " << amsgrad << " step " << step;
    }
    EXPECT_TRUE(torch::equal(eager[2].detach(), missed_before));
    // Called again (as after a resume), it keeps every existing state.
    auto& s0 = static_cast<torch::optim::AdamParamState&>(*eager_adam.state().begin()->second);
    const auto moment = s0.exp_avg().clone();
    const auto steps = s0.step();
    kernels::allocate_adam_state(eager_adam);
    EXPECT_EQ(eager_adam.state().size(), 3u);
    EXPECT_EQ(s0.step(), steps);
    EXPECT_TRUE(torch::equal(s0.exp_avg(), moment));
  }
  // Other optimizers are left alone.
  torch::optim::SGD sgd(make(), torch::optim::SGDOptions(0.1).momentum(0.9));
  kernels::allocate_adam_state(sgd);
  EXPECT_EQ(sgd.state().size(), 0u);
}

TEST(LoopTest, ShuffledEpochsVisitEveryExampleOnceWithAShortLastBatch) {
  TempDir dir;
  RegressionTask task(10, /*shuffle=*/true);
  auto o = options(dir / "run");
  o.epochs = 2;  // 3 steps per epoch: 4 + 4 + 2
  std::ostringstream log;
  auto r = train::run(task, o, log);
  EXPECT_EQ(r.end_step, 6);
  ASSERT_EQ(task.seen.size(), 6u);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::multiset<int64_t> ids;
    for (int s = 0; s < 3; ++s)
      for (int64_t i = 0; i < task.seen[epoch * 3 + s].size(0); ++i) ids.insert(task.seen[epoch * 3 + s][i].item<int64_t>());
    EXPECT_EQ(ids, (std::multiset<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})) << "epoch " << epoch;
    EXPECT_EQ(task.seen[epoch * 3 + 2].size(0), 2);
  }
  EXPECT_FALSE(torch::equal(task.seen[0], task.seen[3])) << "each epoch has its own order";
  // Evaluated at both epoch ends; the epoch lines carry the evaluation.
  EXPECT_EQ(task.evaluations, 2);
  EXPECT_NE(log.str().find("epoch 2: train loss"), std::string::npos) << log.str();
  // The learning rate decays smoothly by lr_decay per epoch: step s trains with 0.05 * 0.5^(s / 3).
  auto train_records = records(o.out_dir, "train");
  ASSERT_EQ(train_records.size(), 6u);
  for (int s = 0; s < 6; ++s) EXPECT_NEAR(train_records[s]["lr"].get<double>(), 0.05 * std::pow(0.5, s / 3.0), 1e-12);
  EXPECT_EQ(train_records[5]["images_seen"], 20);
  EXPECT_EQ(records(o.out_dir, "eval").size(), 2u);
}

TEST(LoopTest, AStreamTakesConsecutiveFullBatches) {
  TempDir dir;
  RegressionTask task(10, /*shuffle=*/false);
  auto o = options(dir / "run");
  o.epochs = 0;
  o.max_steps = 4;
  o.evaluate_each_epoch = false;
  std::ostringstream log;
  train::run(task, o, log);
  ASSERT_EQ(task.seen.size(), 4u);
  for (int64_t s = 0; s < 4; ++s)
    EXPECT_TRUE(torch::equal(task.seen[s], torch::arange(4 * s, 4 * s + 4, torch::kLong))) << "step " << s;
  EXPECT_EQ(task.evaluations, 1) << "evaluated once, at the end";
}

TEST(LoopTest, ResumeReproducesTheUninterruptedRunAndChecksTheOptions) {
  TempDir dir;
  std::ostringstream log;
  RegressionTask a(10, true), b(10, true), c(10, true);
  auto full = options(dir / "full");
  full.max_steps = 7;
  auto ra = train::run(a, full, log);
  auto part = options(dir / "part");
  part.max_steps = 4;
  auto rb = train::run(b, part, log);
  auto rest = options(dir / "rest");
  rest.max_steps = 7;
  rest.resume = rb.checkpoint;
  auto rc = train::run(c, rest, log);
  ASSERT_EQ(rc.start_step, 4);
  ASSERT_EQ(rc.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rc.losses[i], ra.losses[i + 4]) << "step " << i + 4;
  EXPECT_TRUE(torch::equal(a.model_->weight, c.model_->weight));

  RegressionTask d(10, true);
  auto changed = options(dir / "changed");
  changed.max_steps = 7;
  changed.resume = rb.checkpoint;
  changed.lr = 0.1;
  try {
    train::run(d, changed, log);
    FAIL() << "expected a refused resume";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("option lr"), std::string::npos) << e.what();
  }
  RegressionTask e(12, true);  // another data set: its size is part of the data config
  auto other = options(dir / "other");
  other.max_steps = 7;
  other.resume = rb.checkpoint;
  EXPECT_THROW(train::run(e, other, log), std::invalid_argument);
}

TEST(LoopTest, ANonFiniteLossStopsWithTheLastGoodCheckpoint) {
  TempDir dir;
  RegressionTask task(10, true);
  task.nan_at_step = 5;  // checkpoints after steps 2, 3 (epoch end) and 4
  auto o = options(dir / "run");
  o.max_steps = 8;
  o.checkpoint_every = 2;
  std::ostringstream log;
  try {
    train::run(task, o, log);
    FAIL() << "expected TrainingDiverged";
  } catch (const train::TrainingDiverged& err) {
    const std::string msg = err.what();
    EXPECT_NE(msg.find("loss is nan at step 5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(step 4)"), std::string::npos) << msg;
  }
  EXPECT_EQ(train::read_checkpoint_meta(train::checkpoint_path(o.out_dir)).step, 4);
}

TEST(LoopTest, ATimeBudgetStopsAfterTheStepThatSpendsItAndStillSavesAndEvaluates) {
  TempDir dir;
  RegressionTask task(10, true);
  auto o = options(dir / "run");
  o.max_steps = 50;
  o.max_seconds = 1e-9;
  o.evaluate_each_epoch = false;
  std::ostringstream log;
  auto r = train::run(task, o, log);
  EXPECT_TRUE(r.out_of_time);
  EXPECT_EQ(r.end_step, 1);
  EXPECT_EQ(task.evaluations, 1);
  EXPECT_EQ(train::read_checkpoint_meta(r.checkpoint).step, 1);
  EXPECT_NE(log.str().find("stopping after step 1 of 50"), std::string::npos) << log.str();
}

TEST(LoopTest, OneCycleWarmsUpToThePeakThenAnnealsToNearZeroAndFixesItsLength) {
  // The formula, against values written out by hand: lr/25 at the start, the peak at the end of the
  // warm-up, half-way down the cosine at the middle of the descent, lr/1e4 at the last step.
  train::LoopOptions o;
  o.lr = 0.01;
  o.lr_schedule = train::LrSchedule::kOneCycle;
  o.warmup_fraction = 0.25;
  const int64_t n = 101;  // t = step / 100
  EXPECT_NEAR(o.learning_rate(0, n, 0), 0.01 / 25, 1e-15);
  EXPECT_NEAR(o.learning_rate(10, n, 0), 0.0004 + (0.01 - 0.0004) * 0.4, 1e-15);
  EXPECT_NEAR(o.learning_rate(25, n, 0), 0.01, 1e-15);
  EXPECT_NEAR(o.learning_rate(62, n, 0), 1e-6 + (0.01 - 1e-6) * 0.5 * (1 + std::cos(M_PI * 37 / 75.0)), 1e-12);
  EXPECT_NEAR(o.learning_rate(100, n, 0), 0.01 / 1e4, 1e-15);
  for (int64_t s = 1; s < n; ++s) {
    if (s <= 25) EXPECT_GT(o.learning_rate(s, n, 0), o.learning_rate(s - 1, n, 0)) << s;
    else EXPECT_LT(o.learning_rate(s, n, 0), o.learning_rate(s - 1, n, 0)) << s;
  }
  // The exponential schedule ignores the step count: lr * decay^(epochs done).
  o.lr_schedule = train::LrSchedule::kExponential;
  o.lr_decay = 0.5;
  EXPECT_NEAR(o.learning_rate(7, n, 2.0), 0.0025, 1e-15);

  // Through the loop: each record's lr is the schedule's, and a resume that would stretch the cycle
  // (another number of steps) is refused, while the same length resumes exactly.
  TempDir dir;
  std::ostringstream log;
  RegressionTask a(10, true), b(10, true), c(10, true), d(10, true);
  auto full = options(dir / "full");
  full.lr_schedule = train::LrSchedule::kOneCycle;
  full.max_steps = 9;
  auto ra = train::run(a, full, log);
  auto recs = records(full.out_dir, "train");
  ASSERT_EQ(recs.size(), 9u);
  for (int64_t s = 0; s < 9; ++s) EXPECT_NEAR(recs[s]["lr"].get<double>(), full.learning_rate(s, 9, 0), 1e-12) << s;
  EXPECT_NEAR(recs[8]["lr"].get<double>(), 0.05 / 1e4, 1e-12);

  auto part = full;
  part.out_dir = dir / "part";
  part.max_steps = 9;
  part.max_seconds = 1e-9;  // stops after its first step, as an interrupted run would
  auto rb = train::run(b, part, log);
  ASSERT_EQ(rb.end_step, 1);
  auto rest = full;
  rest.out_dir = dir / "rest";
  rest.resume = rb.checkpoint;
  auto rc = train::run(c, rest, log);
  ASSERT_EQ(rc.losses.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(rc.losses[i], ra.losses[i + 1]) << "step " << i + 1;

  auto longer = rest;
  longer.out_dir = dir / "longer";
  longer.max_steps = 20;
  try {
    train::run(d, longer, log);
    FAIL() << "a resume with another cycle length was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("schedule_steps"), std::string::npos) << e.what();
  }
}

/// The regression task whose held-out accuracy follows a script, one value per evaluation (then 0): the
/// test evaluation's (kTest) or the epoch-end validation's (kValidation, which also reports a loss of 1).
class ScriptedTask : public RegressionTask {
 public:
  enum class Split { kTest, kValidation, kValidationWithoutLoss };
  ScriptedTask(Split split, std::vector<double> accuracies)
      : RegressionTask(10, true), split_(split), accuracies_(std::move(accuracies)) {}
  std::optional<train::Evaluation> evaluate(std::ostream* log) override {
    if (split_ != Split::kTest) return RegressionTask::evaluate(log);
    const double acc = next(evaluations);
    return train::Evaluation{{{"accuracy", acc}}, fmt::format("accuracy {}", acc)};
  }
  std::optional<train::Evaluation> evaluate_validation(std::ostream* log) override {
    if (split_ == Split::kTest) return RegressionTask::evaluate_validation(log);
    const double acc = next(validations_);
    if (split_ == Split::kValidationWithoutLoss) return train::Evaluation{{{"accuracy", acc}}, fmt::format("val {}", acc)};
    return train::Evaluation{{{"accuracy", acc}, {"loss", 1.0}}, fmt::format("val {}", acc)};
  }

 private:
  double next(int64_t& counter) const {
    const size_t k = static_cast<size_t>(counter++);
    return k < accuracies_.size() ? accuracies_[k] : 0.0;
  }
  Split split_;
  std::vector<double> accuracies_;
  int64_t validations_ = 0;
};

TEST(LoopTest, ATargetAccuracyStopsAtTheFirstEpochThatReachesIt) {
  TempDir dir;
  std::ostringstream log;
  ScriptedTask task(ScriptedTask::Split::kTest, {0.5, 0.89, 0.9, 0.95});
  auto o = options(dir / "run");
  o.epochs = 5;  // 3 steps per epoch
  o.target_accuracy = 0.9;
  auto r = train::run(task, o, log);
  EXPECT_TRUE(r.target_reached);
  EXPECT_EQ(r.end_step, 9) << "stopped at the end of epoch 3, whose accuracy (0.9) equals the target";
  EXPECT_EQ(task.evaluations, 3);
  EXPECT_NE(log.str().find("target accuracy 90.00% is reached"), std::string::npos) << log.str();
  auto end = records(o.out_dir, "end");
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0]["target_reached"], true);
  EXPECT_EQ(end[0]["step"], 9);
  EXPECT_EQ(train::read_checkpoint_meta(train::checkpoint_path(o.out_dir)).step, 9) << "the stopping epoch is saved";

  // Never reached: every epoch runs, and the end record says so.
  ScriptedTask never(ScriptedTask::Split::kTest, {0.1, 0.2});
  auto o2 = options(dir / "never");
  o2.epochs = 2;
  o2.target_accuracy = 0.9;
  auto r2 = train::run(never, o2, log);
  EXPECT_FALSE(r2.target_reached);
  EXPECT_EQ(r2.end_step, 6);
  EXPECT_EQ(records(o2.out_dir, "end").at(0)["target_reached"], false);

  // A task whose evaluation has no "accuracy" never stops early.
  RegressionTask mse_only(10, true);
  auto o3 = options(dir / "mse");
  o3.epochs = 2;
  o3.target_accuracy = 0.5;
  EXPECT_EQ(train::run(mse_only, o3, log).end_step, 6);
}

TEST(LoopTest, AnAccuracyOnlyValidationRecordsNoLoss) {
  TempDir dir;
  std::ostringstream log;
  // Validations without a "loss" (a classifier scored by accuracy alone): epochs 1-3 score 0.5, 0.7, 0.7. The
  // tie goes to the first (step 6); no loss is invented in the result, the end record or the checkpoints.
  auto o = options(dir / "run");
  o.epochs = 3;
  ScriptedTask task(ScriptedTask::Split::kValidationWithoutLoss, {0.5, 0.7, 0.7});
  auto r = train::run(task, o, log);
  EXPECT_EQ(r.best_validation_step, 6);
  ASSERT_TRUE(r.best_validation_accuracy.has_value());
  EXPECT_EQ(*r.best_validation_accuracy, 0.7);
  EXPECT_FALSE(r.best_validation_loss.has_value());
  auto end = records(o.out_dir, "end").at(0);
  EXPECT_EQ(end["best_val_accuracy"], 0.7);
  EXPECT_EQ(end["best_step"], 6);
  EXPECT_FALSE(end.contains("best_val_loss")) << end.dump();
  const auto best = train::read_checkpoint_meta(train::checkpoint_path(o.out_dir)).train_options.at("best_validation");
  EXPECT_EQ(best.at("step"), 6);
  EXPECT_EQ(best.at("accuracy"), 0.7);
  EXPECT_FALSE(best.contains("loss")) << best.dump();

  // Resumed for a 4th epoch scoring 0.7 again: the kept best (step 6) still wins the tie.
  auto resumed = o;
  resumed.epochs = 4;
  resumed.resume = train::checkpoint_path(o.out_dir);
  ScriptedTask again(ScriptedTask::Split::kValidationWithoutLoss, {0.7});
  auto r2 = train::run(again, resumed, log);
  EXPECT_EQ(r2.end_step, 12);
  EXPECT_EQ(r2.best_validation_step, 6);
  EXPECT_FALSE(r2.best_validation_loss.has_value());
}

TEST(LoopTest, ATargetAccuracyIsCheckedAtEvalEveryValidationsToo) {
  TempDir dir;
  std::ostringstream log;
  // Epochs of 3 steps, validated every 2nd step too: steps 2 (0.5), 3 (epoch end, 0.6), 4 (0.9). Step 4
  // reaches the target: the run stops there, saved, best.pt and tested as a last step.
  const auto validated = [&](const std::string& name, bool tests) {
    auto o = options(dir / name);
    o.epochs = 5;
    o.eval_every = 2;
    o.eval_every_tests = tests;
    o.target_accuracy = 0.9;
    return o;
  };
  auto o = validated("val", true);
  ScriptedTask task(ScriptedTask::Split::kValidation, {0.5, 0.6, 0.9, 0.95});
  auto r = train::run(task, o, log);
  EXPECT_TRUE(r.target_reached);
  EXPECT_EQ(r.end_step, 4);
  EXPECT_EQ(r.best_validation_step, 4);
  EXPECT_EQ(task.evaluations, 3) << "the test set at step 2 (a curve point), 3 (epoch end) and 4 (the stop)";
  EXPECT_EQ(train::read_checkpoint_meta(train::checkpoint_path(o.out_dir)).step, 4);
  EXPECT_EQ(train::read_checkpoint_meta(train::best_checkpoint_path(o.out_dir)).step, 4);
  EXPECT_NE(log.str().find("stopping after step 4 of 15: the target accuracy 90.00% is reached"), std::string::npos)
      << log.str();
  auto end = records(o.out_dir, "end").at(0);
  EXPECT_EQ(end["target_reached"], true);
  EXPECT_EQ(end["step"], 4);

  // eval_every_tests = false: the curve points validate only; the epoch end and the stop are still tested.
  auto o2 = validated("val-only", false);
  ScriptedTask quiet(ScriptedTask::Split::kValidation, {0.5, 0.6, 0.9});
  auto r2 = train::run(quiet, o2, log);
  EXPECT_EQ(r2.end_step, 4);
  EXPECT_EQ(quiet.evaluations, 2);
  std::vector<int64_t> tested;
  for (const auto& e : records(o2.out_dir, "eval"))
    if (e["split"] == "test") tested.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(tested, (std::vector<int64_t>{3, 4}));

  // Without a validation split the curve points' test accuracy never stops the run (0.95 at step 2); the
  // epoch ends do (step 3: 0.5, step 6: 0.9, after the curve point at step 4: 0.7).
  auto o3 = validated("test", true);
  ScriptedTask tested_only(ScriptedTask::Split::kTest, {0.95, 0.5, 0.7, 0.9});
  auto r3 = train::run(tested_only, o3, log);
  EXPECT_TRUE(r3.target_reached);
  EXPECT_EQ(r3.end_step, 6);
}

TEST(LoopTest, BestPtIsTheFoldersOwnRunsOrNone) {
  TempDir dir;
  std::ostringstream log;
  ScriptedTask first(ScriptedTask::Split::kValidation, {0.5, 0.9});
  auto o = options(dir / "a");
  o.epochs = 2;  // 3 steps per epoch
  auto a = train::run(first, o, log);
  ASSERT_EQ(a.best_validation_step, 6);
  const auto best_a = train::best_checkpoint_path(o.out_dir);
  ASSERT_TRUE(std::filesystem::exists(best_a));

  // Continued in its own folder with a worse epoch: best.pt stays, the best is remembered.
  ScriptedTask worse(ScriptedTask::Split::kValidation, {0.4});
  auto more = o;
  more.epochs = 3;
  more.resume = a.checkpoint;
  auto b = train::run(worse, more, log);
  EXPECT_EQ(b.best_validation_step, 6);
  EXPECT_EQ(train::read_checkpoint_meta(best_a).step, 6);

  // Continued in another folder: that folder's best.pt is an older run's, not this one's, and goes at the
  // first save; the worse epoch writes none, so the folder has no best.pt (the best stays in a's folder).
  const std::string other = dir / "other";
  std::filesystem::create_directories(other);
  std::ofstream(train::best_checkpoint_path(other)) << "an older run's best";
  ScriptedTask elsewhere(ScriptedTask::Split::kValidation, {0.4});
  auto moved = more;
  moved.out_dir = other;
  moved.epochs = 4;
  moved.resume = b.checkpoint;  // step 9, in a's folder
  auto c = train::run(elsewhere, moved, log);
  EXPECT_EQ(c.end_step, 12);
  EXPECT_EQ(c.best_validation_step, 6);
  EXPECT_FALSE(std::filesystem::exists(train::best_checkpoint_path(other)));
}

TEST(LoopTest, EvalEveryAddsMidEpochEvaluationsAtThoseStepsOnly) {
  TempDir dir;
  std::ostringstream log;
  // A stream of 10 steps, evaluated at the end only, plus every 4th step: steps 4, 8 and 10.
  RegressionTask stream(10, /*shuffle=*/false);
  auto o = options(dir / "stream");
  o.epochs = 0;
  o.max_steps = 10;
  o.evaluate_each_epoch = false;
  o.eval_every = 4;
  train::run(stream, o, log);
  EXPECT_EQ(stream.evaluations, 3);
  std::vector<int64_t> steps;
  for (const auto& r : records(o.out_dir, "eval")) {
    steps.push_back(r["step"].get<int64_t>());
    EXPECT_TRUE(r.contains("mse")) << r.dump();
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 8, 10}));
  EXPECT_NE(log.str().find("step 4 (epoch"), std::string::npos) << log.str();

  // Epochs of 3 steps, evaluated at each end: eval_every = 3 coincides with them and adds nothing;
  // eval_every = 2 adds steps 2 and 4 (step 6 is an epoch end, evaluated once).
  RegressionTask same(10, true);
  auto o2 = options(dir / "same");
  o2.epochs = 2;
  o2.eval_every = 3;
  train::run(same, o2, log);
  EXPECT_EQ(same.evaluations, 2);
  RegressionTask more(10, true);
  auto o3 = options(dir / "more");
  o3.epochs = 2;
  o3.eval_every = 2;
  train::run(more, o3, log);
  EXPECT_EQ(more.evaluations, 4);
  steps.clear();
  for (const auto& r : records(o3.out_dir, "eval")) steps.push_back(r["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 3, 4, 6}));
}

/// A stream whose validation reports only a scripted "loss" (lower is better, as a generator's L1).
class LossOnlyValidation : public RegressionTask {
 public:
  explicit LossOnlyValidation(std::vector<double> losses) : RegressionTask(10, false), losses_(std::move(losses)) {}
  std::optional<train::Evaluation> evaluate_validation(std::ostream*) override {
    const size_t k = static_cast<size_t>(validations++);
    const double l = k < losses_.size() ? losses_[k] : 100.0;
    return train::Evaluation{{{"loss", l}}, fmt::format("val loss {}", l)};
  }
  int64_t validations = 0;

 private:
  std::vector<double> losses_;
};

TEST(LoopTest, LossOnlyValidationKeepsTheLowestAndPatienceStopsTheRun) {
  TempDir dir;
  std::ostringstream log;
  // A stream of `steps` steps, validated (and tested) every 2nd step and at the end, saved only there.
  const auto stream = [&](const std::string& name, int64_t steps, int64_t patience) {
    auto o = options(dir / name);
    o.epochs = 0;
    o.max_steps = steps;
    o.evaluate_each_epoch = false;
    o.checkpoint_every = 0;
    o.eval_every = 2;
    o.patience_steps = patience;
    return o;
  };
  auto o = stream("run", 20, 4);
  // Validations at steps 2, 4, 6, 8: losses 5, 3, 4, 3 (a tie is no improvement). At step 8 the best (step 4)
  // is 4 steps old: the run stops there, saved and tested as a last step.
  LossOnlyValidation task({5, 3, 4, 3});
  auto r = train::run(task, o, log);
  EXPECT_TRUE(r.patience_spent);
  EXPECT_EQ(r.end_step, 8);
  EXPECT_EQ(r.best_validation_step, 4);
  ASSERT_TRUE(r.best_validation_loss.has_value());
  EXPECT_EQ(*r.best_validation_loss, 3.0);
  EXPECT_FALSE(r.best_validation_accuracy.has_value());
  EXPECT_EQ(task.validations, 4);
  EXPECT_EQ(task.evaluations, 4) << "the test set at 2, 4, 6 and at the stop";
  EXPECT_EQ(train::read_checkpoint_meta(train::best_checkpoint_path(o.out_dir)).step, 4);
  EXPECT_EQ(train::read_checkpoint_meta(train::checkpoint_path(o.out_dir)).step, 8);
  EXPECT_NE(
      log.str().find("stopping after step 8 of 20: no better validation for 4 steps (patience 4; best at step 4)"),
      std::string::npos)
      << log.str();
  std::vector<int64_t> best_steps;
  for (const auto& b : records(o.out_dir, "best")) {
    best_steps.push_back(b["step"].get<int64_t>());
    EXPECT_TRUE(b.contains("val_loss")) << b.dump();
  }
  EXPECT_EQ(best_steps, (std::vector<int64_t>{2, 4}));
  auto end = records(o.out_dir, "end").at(0);
  EXPECT_EQ(end["patience_spent"], true);
  EXPECT_EQ(end["best_val_loss"], 3.0);
  EXPECT_EQ(end["best_step"], 4);
  EXPECT_FALSE(end.contains("best_val_accuracy"));

  // The best survives a resume: 6 steps (best 3 at step 4), then resumed with patience: the first validation
  // after it (step 8, loss 3.5) finds the best 4 steps old.
  auto a = stream("a", 6, 0);
  LossOnlyValidation first({5, 3, 4});
  auto ra = train::run(first, a, log);
  EXPECT_FALSE(ra.patience_spent);
  EXPECT_EQ(ra.end_step, 6);
  auto b = a;
  b.max_steps = 20;
  b.patience_steps = 4;
  b.resume = train::checkpoint_path(a.out_dir);
  LossOnlyValidation second({3.5});
  auto rb = train::run(second, b, log);
  EXPECT_TRUE(rb.patience_spent);
  EXPECT_EQ(rb.end_step, 8);
  EXPECT_EQ(rb.best_validation_step, 4);
  EXPECT_EQ(*rb.best_validation_loss, 3.0);

  // Without patience every step runs; a better validation moves best.pt.
  auto c = stream("c", 20, 0);
  LossOnlyValidation improving({5, 4, 3, 2, 1, 0.5, 0.4, 0.3, 0.2, 0.1});
  auto rc = train::run(improving, c, log);
  EXPECT_FALSE(rc.patience_spent);
  EXPECT_EQ(rc.end_step, 20);
  EXPECT_EQ(rc.best_validation_step, 20);
  EXPECT_EQ(train::read_checkpoint_meta(train::best_checkpoint_path(c.out_dir)).step, 20);
}

/// The weight average of a checkpoint (LoopOptions::ema_decay), read into tensors shaped like `model`'s.
train::NamedTensors stored_average(const std::string& path, torch::nn::Linear& model) {
  train::NamedTensors average;
  for (const auto& p : model->parameters())
    average.emplace_back(fmt::format("p{}", average.size()), torch::zeros_like(p));
  bool found = false;
  train::load_checkpoint(
      path, *model, nullptr, [](const nlohmann::json&) { return true; }, &average, &found);
  EXPECT_TRUE(found) << path;
  return average;
}

TEST(LoopTest, AWeightAverageIsWhatIsEvaluatedAndResumesExactly) {
  TempDir dir;
  std::ostringstream log;
  RegressionTask a(10, true), b(10, true), c(10, true);
  auto full = options(dir / "full");
  full.max_steps = 7;
  full.ema_decay = 0.8;
  auto ra = train::run(a, full, log);
  auto evals = records(full.out_dir, "eval");
  ASSERT_FALSE(evals.empty());
  EXPECT_EQ(evals.back()["weights"], "average");
  EXPECT_EQ(records(full.out_dir, "start").at(0)["train"]["ema_decay"], 0.8);

  // The last evaluation is the average's: the mse of the averaged weights, not of the trained ones.
  const double last_evaluated = a.last_mse;  // what a task's result reports (e.g. capsnet train's last test)
  torch::nn::Linear probe(3, 1);
  const auto average = stored_average(ra.checkpoint, probe);
  const auto trained_mse = a.evaluate(nullptr)->record["mse"].get<double>();
  {
    torch::NoGradGuard no_grad;
    a.model_->weight.copy_(average[0].second);
    a.model_->bias.copy_(average[1].second);
  }
  const auto average_mse = a.evaluate(nullptr)->record["mse"].get<double>();
  EXPECT_EQ(evals.back()["mse"].get<double>(), average_mse);
  EXPECT_EQ(last_evaluated, average_mse) << "the average is evaluated last, after the trained weights";
  EXPECT_NE(average_mse, trained_mse);

  // Interrupted after 4 steps and resumed: the same losses and, bit for bit, the same average.
  auto part = full;
  part.out_dir = dir / "part";
  part.max_steps = 4;
  auto rb = train::run(b, part, log);
  auto rest = full;
  rest.out_dir = dir / "rest";
  rest.resume = rb.checkpoint;
  auto rc = train::run(c, rest, log);
  ASSERT_EQ(rc.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rc.losses[i], ra.losses[i + 4]) << "step " << i + 4;
  torch::nn::Linear probe2(3, 1);
  const auto resumed = stored_average(rc.checkpoint, probe2);
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(resumed[i].second, average[i].second)) << i;

  // The decay is a resume key: another value (or none) would not continue the same average.
  RegressionTask d(10, true);
  auto changed = rest;
  changed.out_dir = dir / "changed";
  changed.ema_decay = 0;
  try {
    train::run(d, changed, log);
    FAIL() << "expected a refused resume";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("option ema_decay"), std::string::npos) << e.what();
  }
}

TEST(LoopTest, WithAWeightAverageTheValidationOfTheAveragePicksBestPtWhichHoldsIt) {
  TempDir dir;
  std::ostringstream log;
  // Each validation point evaluates the trained weights, then the average: steps 3 and 6.
  ScriptedTask task(ScriptedTask::Split::kValidation, {0.99, 0.5, 0.1, 0.9});
  auto o = options(dir / "run");
  o.epochs = 2;  // 3 steps per epoch
  o.ema_decay = 0.5;
  auto r = train::run(task, o, log);
  EXPECT_EQ(r.best_validation_step, 6) << "0.9 (average) beats 0.5; the trained weights' 0.99 chooses nothing";
  std::vector<nlohmann::json> vals;
  for (const auto& j : records(o.out_dir, "eval"))
    if (j["split"] == "val") vals.push_back(j);
  ASSERT_EQ(vals.size(), 2u);
  EXPECT_EQ(vals[0]["accuracy"], 0.5);
  EXPECT_EQ(vals[0]["trained_accuracy"], 0.99);
  EXPECT_EQ(vals[0]["weights"], "average");
  EXPECT_NE(log.str().find("[weight average; trained weights 99.00%]"), std::string::npos) << log.str();

  const auto best = train::best_checkpoint_path(o.out_dir);
  EXPECT_EQ(train::read_checkpoint_meta(best).train_options["weights"], "average");
  torch::nn::Linear from_best(3, 1), from_last(3, 1), probe(3, 1);
  train::load_checkpoint(best, *from_best, nullptr, [](const nlohmann::json&) { return true; });
  train::load_checkpoint(r.checkpoint, *from_last, nullptr, [](const nlohmann::json&) { return true; });
  const auto average = stored_average(r.checkpoint, probe);  // the same step as best.pt
  EXPECT_TRUE(torch::equal(from_best->weight, average[0].second)) << "best.pt's model is the average";
  EXPECT_FALSE(torch::equal(from_last->weight, average[0].second)) << "checkpoint.pt's model is the trained one";
}

TEST(LoopTest, BadOptionsNameTheField) {
  TempDir dir;
  RegressionTask task(10, true);
  std::ostringstream log;
  // options() with one change is refused by an error that names `field`.
  auto expect_field = [&](const std::function<void(train::LoopOptions&)>& change, const std::string& field) {
    auto o = options(dir / "run");
    change(o);
    try {
      train::run(task, o, log);
      FAIL() << "expected std::invalid_argument for " << field;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_field([](auto& o) { o.batch_size = 0; }, "batch_size");
  expect_field([](auto& o) { o.lr_decay = 1.5; }, "lr_decay");
  expect_field([](auto& o) { o.warmup_fraction = 1; }, "warmup_fraction");
  EXPECT_THROW(train::parse_lr_schedule("cosine"), std::invalid_argument);
  expect_field([](auto& o) { o.epochs = 0; }, "nothing to do");
  expect_field([](auto& o) { o.target_accuracy = 1.5; }, "target_accuracy");
  expect_field([](auto& o) { o.target_accuracy = 0.9, o.evaluate_each_epoch = false; }, "evaluate_each_epoch");
  expect_field([](auto& o) { o.eval_every = -1; }, "eval_every");
  expect_field([](auto& o) { o.patience_steps = -1; }, "patience_steps");
  expect_field([](auto& o) { o.ema_decay = 1; }, "ema_decay");
  expect_field([](auto& o) { o.ema_decay = -0.1; }, "ema_decay");
  RegressionTask empty(0, true);
  EXPECT_THROW(train::run(empty, options(dir / "run"), log), std::invalid_argument);
}

}  // namespace
}  // namespace capsnet
