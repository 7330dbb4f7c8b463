// Training loop, checkpoints and exact resume, on a tiny model and synthetic data.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "capsnet/train/checkpoint.h"
#include "capsnet/train/evaluate.h"
#include "capsnet/train/trainer.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::TempDir;

train::TrainOptions tiny_options(const std::string& out_dir) {
  train::TrainOptions o;
  o.model = testing::tiny_config();
  o.loop.out_dir = out_dir;
  o.loop.batch_size = 16;
  o.loop.lr = 3e-3;
  o.max_shift = 1;
  o.loop.seed = 7;
  o.loop.progress = false;
  o.loop.log_every = 2;
  return o;
}

// tiny_options for `epochs` epochs holding out the last 16 examples for validation.
train::TrainOptions validated_options(const std::string& out_dir, int64_t epochs) {
  auto o = tiny_options(out_dir);
  o.validation_size = 16;
  o.loop.epochs = epochs;
  return o;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(TrainerTest, ResumeReproducesTheUninterruptedRunExactly) {
  auto set = testing::synthetic_set(50, 12, 1);  // 4 steps per epoch, the last one partial
  TempDir dir;
  std::ostringstream log;

  auto full = tiny_options(dir / "full");
  full.loop.max_steps = 7;  // crosses two epoch boundaries
  auto a = train::train(full, set, nullptr, log);
  ASSERT_EQ(a.losses.size(), 7u);

  auto first = tiny_options(dir / "part");
  first.loop.max_steps = 3;
  auto b = train::train(first, set, nullptr, log);
  ASSERT_EQ(b.losses.size(), 3u);

  auto rest = tiny_options(dir / "rest");
  rest.loop.max_steps = 7;
  rest.loop.resume = b.checkpoint;
  auto c = train::train(rest, set, nullptr, log);
  ASSERT_EQ(c.start_step, 3);
  ASSERT_EQ(c.losses.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b.losses[i], a.losses[i]) << "step " << i;
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(c.losses[i], a.losses[i + 3]) << "step " << i + 3;

  // The resumed weights end where the uninterrupted ones did.
  auto wa = train::load_model(a.checkpoint), wc = train::load_model(c.checkpoint);
  auto pa = wa->parameters(), pc = wc->parameters();
  ASSERT_EQ(pa.size(), pc.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pc[i])) << "parameter " << i;
}

TEST(TrainerTest, LossDecreasesAndMetricsAreWritten) {
  auto set = testing::synthetic_set(160, 12, 2);
  auto test = testing::synthetic_set(40, 12, 3);
  TempDir dir;
  std::ostringstream log;
  auto o = tiny_options(dir / "run");
  o.loop.epochs = 4;
  auto r = train::train(o, set, &test, log);
  ASSERT_EQ(r.losses.size(), 40u);
  double head = 0, tail = 0;
  for (int i = 0; i < 5; ++i) head += r.losses[i], tail += r.losses[r.losses.size() - 1 - i];
  EXPECT_LT(tail, 0.7 * head) << log.str();
  ASSERT_TRUE(r.test.has_value());
  EXPECT_EQ(r.test->examples, 40);
  EXPECT_EQ(r.test->confusion.sum().item<int64_t>(), 40);

  auto records = read_jsonl(train::metrics_path(o.loop.out_dir));
  ASSERT_FALSE(records.empty());
  EXPECT_EQ(records.front()["event"], "start");
  EXPECT_EQ(records.front()["parameters"], models::count_parameters(*models::CapsNet(o.model)));
  EXPECT_EQ(records.back()["event"], "end");
  int evals = 0, trains = 0;
  for (const auto& j : records) {
    if (j["event"] == "eval") {
      ++evals;
      EXPECT_GE(j["accuracy"].get<double>(), 0.0);
      EXPECT_LE(j["accuracy"].get<double>(), 1.0);
    }
    if (j["event"] == "train") {
      ++trains;
      EXPECT_TRUE(std::isfinite(j["loss"].get<double>()));
      EXPECT_GT(j["lr"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(evals, 4);   // one per epoch
  EXPECT_EQ(trains, 20); // every 2 steps
}

// The learning rate of every step of a run on 32 examples (2 steps per epoch), x0.5 per decay period.
std::vector<double> logged_rates(const std::string& out_dir, int64_t steps, int64_t lr_decay_steps) {
  auto set = testing::synthetic_set(32, 12, 4);
  std::ostringstream log;
  auto o = tiny_options(out_dir);
  o.loop.max_steps = steps;
  o.loop.log_every = 1;
  o.loop.lr_decay = 0.5;
  o.loop.lr_decay_steps = lr_decay_steps;
  train::train(o, set, nullptr, log);
  std::vector<double> lrs;
  for (const auto& j : read_jsonl(train::metrics_path(o.loop.out_dir)))
    if (j["event"] == "train") lrs.push_back(j["lr"].get<double>());
  return lrs;
}

TEST(TrainerTest, LearningRateDecaysPerEpoch) {
  TempDir dir;
  const double lr = tiny_options("").loop.lr;
  const auto lrs = logged_rates(dir / "run", 4, 0);
  ASSERT_EQ(lrs.size(), 4u);
  EXPECT_DOUBLE_EQ(lrs[0], lr);                  // step 0
  EXPECT_DOUBLE_EQ(lrs[1], lr * std::sqrt(0.5));  // half an epoch
  EXPECT_DOUBLE_EQ(lrs[2], lr * 0.5);             // one epoch
}

TEST(TrainerTest, LearningRateDecaysPerPeriodOfSteps) {
  // The authors' schedule: x lr_decay every lr_decay_steps steps, whatever the epoch length (smoothly).
  TempDir dir;
  const double lr = tiny_options("").loop.lr;
  const auto lrs = logged_rates(dir / "run", 5, 4);
  ASSERT_EQ(lrs.size(), 5u);
  EXPECT_DOUBLE_EQ(lrs[0], lr);
  EXPECT_DOUBLE_EQ(lrs[2], lr * std::sqrt(0.5));  // 2 steps = half a period (one epoch)
  EXPECT_DOUBLE_EQ(lrs[4], lr * 0.5);             // 4 steps = one period

  auto o = tiny_options(dir / "bad");
  o.loop.lr_decay_steps = -1;
  EXPECT_THROW(o.validate(), std::invalid_argument);
}

TEST(TrainerTest, ValidationSplitIsTheLastExamplesAndPicksTheBestCheckpoint) {
  auto set = testing::synthetic_set(64, 12, 6);  // 48 train (3 steps per epoch) + 16 validation
  auto test = testing::synthetic_set(24, 12, 7);
  TempDir dir;
  std::ostringstream log;
  auto o = validated_options(dir / "run", 4);
  auto r = train::train(o, set, &test, log);
  EXPECT_EQ(r.losses.size(), 12u) << "the held-out examples are not trained on";
  ASSERT_TRUE(r.validation && r.test);
  EXPECT_EQ(r.validation->examples, 16);
  EXPECT_EQ(r.test->examples, 24);

  // The split is the last 16 examples: the validation result equals an evaluation of the final weights
  // on exactly those rows.
  auto model = train::load_model(r.checkpoint);
  data::ImageSet last{set.images.narrow(0, 48, 16), set.labels.narrow(0, 48, 16)};
  EXPECT_DOUBLE_EQ(train::evaluate(model, last, 100).loss, r.validation->loss);

  // One validation and one test record per epoch; best.pt is the epoch with the best validation
  // accuracy (ties: lower loss), and its checkpoint says so.
  std::vector<nlohmann::json> vals;
  int tests = 0;
  auto records = read_jsonl(train::metrics_path(o.loop.out_dir));
  for (const auto& j : records) {
    if (j["event"] == "eval" && j["split"] == "val") vals.push_back(j);
    if (j["event"] == "eval" && j["split"] == "test") ++tests;
  }
  ASSERT_EQ(vals.size(), 4u);
  EXPECT_EQ(tests, 4);
  EXPECT_EQ(records.front()["train"]["validation_size"], 16);
  EXPECT_EQ(records.front()["train"]["train_examples"], 48);
  size_t best = 0;
  for (size_t i = 1; i < vals.size(); ++i) {
    const double a = vals[i]["accuracy"], b = vals[best]["accuracy"];
    if (a > b || (a == b && vals[i]["loss"].get<double>() < vals[best]["loss"].get<double>())) best = i;
  }
  ASSERT_TRUE(r.best_validation_accuracy);
  EXPECT_EQ(*r.best_validation_accuracy, vals[best]["accuracy"].get<double>());
  EXPECT_EQ(r.best_validation_step, vals[best]["step"].get<int64_t>());
  const auto best_path = train::best_checkpoint_path(o.loop.out_dir);
  const auto meta = train::read_checkpoint_meta(best_path);
  EXPECT_EQ(meta.step, r.best_validation_step);
  EXPECT_EQ(meta.train_options["best_validation"]["step"], r.best_validation_step);
  auto best_model = train::load_model(best_path);
  EXPECT_DOUBLE_EQ(train::evaluate(best_model, last, 100).loss, vals[best]["loss"].get<double>());
}

TEST(TrainerTest, AResumeKeepsTheBestValidationAndAFreshRunDropsTheOldBest) {
  auto set = testing::synthetic_set(64, 12, 6);
  TempDir dir;
  std::ostringstream log;
  auto o = validated_options(dir / "run", 2);
  auto a = train::train(o, set, nullptr, log);
  ASSERT_TRUE(a.best_validation_accuracy);
  auto rest = o;
  rest.loop.epochs = 3;
  rest.loop.resume = a.checkpoint;
  auto b = train::train(rest, set, nullptr, log);
  ASSERT_TRUE(b.best_validation_accuracy);
  EXPECT_GE(*b.best_validation_accuracy, *a.best_validation_accuracy);  // the earlier best is remembered
  if (b.best_validation_step == a.best_validation_step)
    EXPECT_EQ(*b.best_validation_accuracy, *a.best_validation_accuracy);
  EXPECT_TRUE(std::filesystem::exists(train::best_checkpoint_path(o.loop.out_dir)));  // its own: kept

  // A validation split larger than the data, and a negative one, are refused by name.
  auto bad = o;
  bad.validation_size = 64;
  EXPECT_THROW(train::train(bad, set, nullptr, log), std::invalid_argument);
  bad.validation_size = -1;
  EXPECT_THROW(bad.validate(), std::invalid_argument);

  // A fresh run without validation in the same folder leaves no stale best.pt behind.
  auto fresh = tiny_options(o.loop.out_dir);
  fresh.loop.max_steps = 1;
  train::train(fresh, set, nullptr, log);
  EXPECT_FALSE(std::filesystem::exists(train::best_checkpoint_path(o.loop.out_dir)));
}

TEST(TrainerTest, DivergenceStopsWithClearErrorAndKeepsLastGoodCheckpoint) {
  auto set = testing::synthetic_set(64, 12, 5);
  TempDir dir;
  std::ostringstream log;
  auto o = tiny_options(dir / "run");
  o.loop.max_steps = 20;
  o.loop.checkpoint_every = 1;
  o.loop.lr = 1e30;  // the first Adam step moves every weight by ~1e30: the next forward overflows
  try {
    train::train(o, set, nullptr, log);
    FAIL() << "expected TrainingDiverged";
  } catch (const train::TrainingDiverged& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step"), std::string::npos) << msg;
    EXPECT_NE(msg.find("lower learning rate"), std::string::npos) << msg;
  }
  // Whatever checkpoint exists is loadable and finite.
  const auto ckpt = train::checkpoint_path(o.loop.out_dir);
  if (std::filesystem::exists(ckpt)) {
    auto model = train::load_model(ckpt);
    for (const auto& p : model->parameters()) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
  }
}

TEST(TrainerTest, ResumeRejectsOptionsThatWouldChangeTheRun) {
  auto set = testing::synthetic_set(32, 12, 6);
  TempDir dir;
  std::ostringstream log;
  auto o = tiny_options(dir / "run");
  o.loop.max_steps = 1;
  auto r = train::train(o, set, nullptr, log);
  // Each option that changes the sequence of updates is refused by name (the decay period too: a
  // checkpoint from before it had one decays per epoch, 0).
  auto refused = [&](const std::string& option, const std::function<void(train::TrainOptions&)>& change) {
    auto again = tiny_options(dir / "run2");
    again.loop.max_steps = 2;
    again.loop.resume = r.checkpoint;
    change(again);
    try {
      train::train(again, set, nullptr, log);
      ADD_FAILURE() << option << ": expected std::invalid_argument";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(option), std::string::npos) << e.what();
    }
  };
  refused("batch_size", [](train::TrainOptions& t) { t.loop.batch_size = 8; });
  refused("lr_decay_steps", [](train::TrainOptions& t) { t.loop.lr_decay_steps = 2000; });
  refused("hflip", [](train::TrainOptions& t) { t.hflip = true; });
}

TEST(TrainerTest, InvalidOptionsAreRejectedByName) {
  auto set = testing::synthetic_set(8, 12, 7);
  TempDir dir;
  std::ostringstream log;
  auto expect_invalid = [&](train::TrainOptions o, const std::string& phrase) {
    try {
      train::train(o, set, nullptr, log);
      ADD_FAILURE() << "expected invalid_argument mentioning " << phrase;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
    }
  };
  auto base = tiny_options(dir / "x");
  base.loop.max_steps = 1;
  auto o = base;
  o.loop.batch_size = 0;
  expect_invalid(o, "batch_size");
  o = base;
  o.loop.lr = -1;
  expect_invalid(o, "lr must be");
  o = base;
  o.loop.lr_decay = 1.5;
  expect_invalid(o, "lr_decay");
  o = base;
  o.max_shift = 12;
  expect_invalid(o, "max_shift");
  o = base;
  o.model.image_size = 28;  // data is 12x12
  expect_invalid(o, "model expects");
}

TEST(CheckpointTest, RoundTripRestoresWeightsAndMeta) {
  TempDir dir;
  torch::manual_seed(3);
  models::CapsNet model(testing::tiny_config());
  const auto path = dir / "c.pt";
  train::save_checkpoint(path, model, nullptr, {42, model->config.to_json(), {{"batch_size", 5}}});
  auto meta = train::read_checkpoint_meta(path);
  EXPECT_EQ(meta.step, 42);
  EXPECT_EQ(meta.train_options["batch_size"], 5);
  auto loaded = train::load_model(path);
  EXPECT_EQ(loaded->config.to_json(), model->config.to_json());
  auto a = model->parameters(), b = loaded->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i]));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp." + std::to_string(::getpid())));
}

TEST(CheckpointTest, DamagedFilesGiveAClearError) {
  TempDir dir;
  models::CapsNet model(testing::tiny_config());
  const auto good = dir / "good.pt";
  train::save_checkpoint(good, model, nullptr, {1, model->config.to_json(), {}});
  const auto size = std::filesystem::file_size(good);

  auto expect_error = [](const std::string& path, const std::string& phrase) {
    try {
      train::load_model(path);
      ADD_FAILURE() << "expected CheckpointError for " << path;
    } catch (const train::CheckpointError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(phrase), std::string::npos) << msg;
    }
  };
  expect_error(dir / "missing.pt", "no such file");

  const auto truncated = dir / "truncated.pt";
  std::filesystem::copy_file(good, truncated);
  std::filesystem::resize_file(truncated, size / 2);
  expect_error(truncated, "cannot be read");

  const auto garbage = dir / "garbage.pt";
  std::ofstream(garbage) << "this is not a checkpoint";
  expect_error(garbage, "cannot be read");

  // A valid torch archive without capsnet metadata.
  const auto foreign = dir / "foreign.pt";
  torch::save(torch::ones({3}), foreign);
  expect_error(foreign, "capsnet");
}

TEST(CheckpointTest, LoadingIntoADifferentModelIsRefused) {
  TempDir dir;
  models::CapsNet model(testing::tiny_config());
  const auto path = dir / "c.pt";
  train::save_checkpoint(path, model, nullptr, {1, model->config.to_json(), {}});
  auto other_config = testing::tiny_config();
  other_config.digit_dim = 6;
  models::CapsNet other(other_config);
  EXPECT_THROW(train::load_checkpoint(path, other, nullptr), train::CheckpointError);
}

}  // namespace
}  // namespace capsnet
