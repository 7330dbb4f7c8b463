#include "apps/experiments/segcaps.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <stdexcept>

#include "capsnet/train/metrics.h"
#include "capsnet/viz/figures.h"

namespace capsnet::experiments {

void SegCapsTrainOptions::validate() const {
  model.validate();
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw std::invalid_argument(fmt::format("segcaps: {} must be positive, got {}", name, v));
  };
  positive("steps", loop.max_steps);
  positive("test_size", test_size);
  positive("eval_batch_size", eval_batch_size);
  if (validation_size < 0)
    throw std::invalid_argument(fmt::format("segcaps: validation_size must be >= 0, got {}", validation_size));
  loop.validate();
  if (!(threshold > 0 && threshold < 1))
    throw std::invalid_argument(fmt::format("segcaps: threshold must be in (0, 1), got {}", threshold));
}

SegmentationEval evaluate_segcaps(models::SegCaps& model, const data::DigitSegmentation& set, int64_t first_n,
                                  int64_t count, int64_t batch_size, double threshold) {
  const auto t0 = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  SegmentationEval r;
  double dice_sum = 0, loss_sum = 0;
  for (int64_t start = 0; start < count; start += batch_size) {
    const int64_t len = std::min(batch_size, count - start);
    auto batch = set.generate(first_n + start, len);
    auto out = model->forward(batch.images, batch.masks);
    loss_sum += model->loss(out, batch.masks, batch.images).item<double>() * static_cast<double>(len);
    dice_sum += data::dice_per_image(out.probability > threshold, batch.masks).sum().item<double>();
  }
  model->train(was_training);
  r.examples = count;
  r.mean_dice = dice_sum / static_cast<double>(count);
  r.loss = loss_sum / static_cast<double>(count);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::vector<double> threshold_grid() {
  std::vector<double> grid;
  for (int k = 1; k <= 19; ++k) grid.push_back(0.05 * k);
  return grid;
}

std::vector<double> dice_by_threshold(models::SegCaps& model, const data::DigitSegmentation& set, int64_t first_n,
                                      int64_t count, int64_t batch_size, const std::vector<double>& thresholds) {
  if (count < 1 || batch_size < 1 || thresholds.empty())
    throw std::invalid_argument("dice_by_threshold: count, batch_size and the threshold list must be non-empty");
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  std::vector<double> sums(thresholds.size(), 0.0);
  for (int64_t start = 0; start < count; start += batch_size) {
    const int64_t len = std::min(batch_size, count - start);
    auto batch = set.generate(first_n + start, len);
    auto prob = model->forward(batch.images).probability;  // [len, 1, S, S]
    for (size_t k = 0; k < thresholds.size(); ++k)
      sums[k] += data::dice_per_image(prob > thresholds[k], batch.masks).sum().item<double>();
  }
  model->train(was_training);
  for (auto& v : sums) v /= static_cast<double>(count);
  return sums;
}

ValidatedThreshold choose_threshold(models::SegCaps& model, const data::DigitSegmentation& val, int64_t val_count,
                                    const data::DigitSegmentation& test, int64_t test_count, int64_t batch_size) {
  ValidatedThreshold c;
  c.thresholds = threshold_grid();
  c.val_dice = dice_by_threshold(model, val, 0, val_count, batch_size, c.thresholds);
  const auto best = std::max_element(c.val_dice.begin(), c.val_dice.end()) - c.val_dice.begin();
  c.best_threshold = c.thresholds[best];
  c.val_dice_at_best = c.val_dice[best];
  c.test_dice_at_best = dice_by_threshold(model, test, 0, test_count, batch_size, {c.best_threshold})[0];
  c.val_examples = val_count;
  c.test_examples = test_count;
  return c;
}

ThresholdBaseline threshold_baseline(const data::DigitSegmentation& tune, int64_t tune_count,
                                     const data::DigitSegmentation& test, int64_t count) {
  if (tune_count < 1 || count < 1) throw std::invalid_argument("threshold_baseline: counts must be positive");
  ThresholdBaseline b;
  auto tune_batch = tune.generate(0, tune_count);
  auto test_batch = test.generate(0, count);
  auto dice_at = [](const data::SegmentationBatch& batch, double t) {
    return data::dice_per_image(batch.images > t, batch.masks).mean().item<double>();
  };
  double best = -1;
  for (const double t : threshold_grid()) {
    b.thresholds.push_back(t);
    b.train_dice.push_back(dice_at(tune_batch, t));
    if (b.train_dice.back() > best) {
      best = b.train_dice.back();
      b.best_threshold = t;
    }
  }
  b.test_dice_at_best = dice_at(test_batch, b.best_threshold);
  b.test_dice_at_half = dice_at(test_batch, 0.5);
  return b;
}

namespace {

/// SegCaps as a train::Task: a stream of generated cluttered-digit images (step s uses images
/// [s B, (s + 1) B)), binary cross-entropy of the capsule length, Dice on a fixed test set.
class SegCapsTask : public train::Task {
 public:
  SegCapsTask(const SegCapsTrainOptions& o, const data::DigitSegmentation& train_set,
              const data::DigitSegmentation& test_set)
      : o_(o), train_(train_set), test_(test_set) {}

  std::string name() const override { return "segcaps"; }
  std::shared_ptr<torch::nn::Module> build_model(Precision precision) override {
    model_ = models::SegCaps(o_.model);
    model_->set_fused_routing(o_.fused_routing);
    model_->set_precision(precision);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return o_.model.to_json(); }
  // Through from_json, so that a config saved before the loss options existed (no keys: plain BCE, no
  // decoder) matches a run with those options at their old values.
  bool config_matches(const nlohmann::json& saved) const override {
    try {
      return models::SegCapsConfig::from_json(saved).to_json() == o_.model.to_json();
    } catch (const std::invalid_argument&) {
      return false;
    }
  }
  nlohmann::json data_config() const override {
    // "val" always: the resume check compares keys present in both (checkpoints from before --val lack it).
    return {{"canvas", train_.canvas_size()}, {"val", o_.validation_size}};
  }
  std::string describe() const override {
    return fmt::format("segcaps ({}x{} generated images)", o_.model.image_size, o_.model.image_size);
  }
  // The whole run is one epoch: there is no learning-rate decay and the test set is scored at the end.
  int64_t epoch_size() const override { return o_.loop.max_steps * o_.loop.batch_size; }
  bool shuffle() const override { return false; }
  train::Batch batch(const torch::Tensor& ids, at::Generator&) const override {
    auto b = train_.generate(ids[0].item<int64_t>(), ids.size(0));
    return {{b.images, b.masks}};  // [B, 1, S, S] each
  }
  train::TaskLoss loss(const train::Batch& rows) override {
    auto out = model_->forward(rows[0], rows[1]);
    auto l = model_->loss_terms(out, rows[1], rows[0]);
    torch::NoGradGuard no_grad;
    auto dice = data::dice_per_image(out.probability > o_.threshold, rows[1]).to(torch::kFloat64).mean();
    return {l.total,
            {{"dice", dice},
             {"bce", l.bce.detach()},
             {"reconstruction_loss", l.reconstruction.detach()},
             {"pos_weight", torch::tensor(l.pos_weight, torch::kFloat64)}}};
  }
  std::optional<train::Evaluation> evaluate(std::ostream*) override {
    last_ = evaluate_segcaps(model_, test_, 0, o_.test_size, o_.eval_batch_size, o_.threshold);
    return train::Evaluation{{{"dice", last_.mean_dice},
                       {"loss", last_.loss},
                       {"examples", last_.examples},
                       {"seconds", last_.seconds}},
                      fmt::format("test Dice {:.3f} ({} images)", last_.mean_dice, last_.examples)};
  }

  models::SegCaps model_{nullptr};
  SegmentationEval last_;

 private:
  const SegCapsTrainOptions& o_;
  const data::DigitSegmentation& train_;
  const data::DigitSegmentation& test_;
};

}  // namespace

SegCapsTrainResult train_segcaps(const SegCapsTrainOptions& options, const data::DigitSegmentation& train_set,
                                 const data::DigitSegmentation& test_set, std::ostream& log,
                                 std::shared_ptr<train::ProcessGroup> group) {
  options.validate();
  if (train_set.canvas_size() != options.model.image_size || test_set.canvas_size() != options.model.image_size)
    throw std::invalid_argument(fmt::format("segcaps: the data canvas ({}) must equal the model image_size ({})",
                                            train_set.canvas_size(), options.model.image_size));
  SegCapsTask task(options, train_set, test_set);
  auto r = train::run(task, options.loop, log, std::move(group));
  return SegCapsTrainResult{train::RunStats::of(r), task.model_, task.last_};
}

torch::Tensor segcaps_figure(models::SegCaps& model, const data::DigitSegmentation& set, int64_t first_n, int64_t rows,
                             double threshold, int64_t zoom) {
  if (rows < 1 || zoom < 1) throw std::invalid_argument("segcaps_figure: rows and zoom must be positive");
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  auto batch = set.generate(first_n, rows);
  auto prob = model->forward(batch.images).probability;  // [rows, 1, S, S]
  model->train(was_training);
  auto big = [zoom](const torch::Tensor& t) {  // [S, S] -> [S z, S z], nearest
    return t.to(torch::kFloat).repeat_interleave(zoom, 0).repeat_interleave(zoom, 1);
  };
  std::vector<torch::Tensor> tiles;
  for (int64_t i = 0; i < rows; ++i) {
    tiles.push_back(big(batch.images[i][0]));
    tiles.push_back(big(batch.masks[i][0]));
    tiles.push_back(big(prob[i][0]));
    tiles.push_back(big((prob[i][0] > threshold).to(torch::kFloat)));
  }
  return viz::tile(tiles, 4);
}

}  // namespace capsnet::experiments
