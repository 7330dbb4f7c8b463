#include "capsnet/train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <iostream>

#include "capsnet/data/transforms.h"

namespace capsnet::train {
namespace {

/// The paper's MNIST experiment (and any labelled image set): CapsNet on randomly shifted images,
/// margin + scaled reconstruction loss, accuracy of the longest capsule.
class ClassificationTask : public Task {
 public:
  ClassificationTask(const TrainOptions& o, const data::ImageSet& train_set, const data::ImageSet* val_set,
                     const data::ImageSet* test_set)
      : o_(o), train_(train_set), val_(val_set), test_(test_set) {}

  std::string name() const override { return "classification"; }
  std::shared_ptr<torch::nn::Module> build_model(Precision precision) override {
    model_ = models::CapsNet(o_.model);
    model_->set_fused_routing(o_.fused_routing);
    model_->set_precision(precision);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return o_.model.to_json(); }
  bool config_matches(const nlohmann::json& saved) const override {
    return models::same_config(saved, o_.model);
  }
  nlohmann::json data_config() const override {
    nlohmann::json j = {{"max_shift", o_.max_shift}, {"train_examples", train_.size()}};
    if (val_) j["validation_size"] = val_->size();  // only when held out: older checkpoints resume
    // Only when present, so the resume check of a run that predates them still matches.
    if (!train_.class_names.empty()) j["classes"] = train_.class_names;
    for (const auto& [key, value] : o_.data_info.items()) j[key] = value;
    return j;
  }
  std::string describe() const override { return "CapsNet"; }
  int64_t epoch_size() const override { return train_.size(); }

  Batch batch(const torch::Tensor& ids, at::Generator& gen) const override {
    auto images = data::random_shift(data::to_float(train_.images.index_select(0, ids)), o_.max_shift, gen);
    return {{images, train_.labels.index_select(0, ids)}};  // [B, C, S, S], [B]
  }
  TaskLoss loss(const Batch& rows) override {
    const auto& images = rows[0];
    const auto& labels = rows[1];
    auto out = model_(images, labels);
    auto l = model_->loss(out, images, labels);
    auto accuracy = out.lengths.detach().argmax(1).eq(labels).to(torch::kFloat64).mean();
    return {l.total, {{"margin_loss", l.margin}, {"reconstruction_loss", l.reconstruction}, {"accuracy", accuracy}}};
  }
  std::optional<Evaluation> evaluate(std::ostream* progress) override {
    if (!test_) return std::nullopt;
    return evaluate_on(*test_, "test", progress, last_);
  }
  std::optional<Evaluation> evaluate_validation(std::ostream* progress) override {
    if (!val_) return std::nullopt;
    return evaluate_on(*val_, "val", progress, last_validation_);
  }

  std::optional<EvalResult> last_, last_validation_;  // the last evaluations, for TrainResult

 private:
  Evaluation evaluate_on(const data::ImageSet& set, const char* split, std::ostream* progress,
                         std::optional<EvalResult>& keep) {
    auto r = train::evaluate(model_, set, o_.eval_batch_size, progress);
    Evaluation e{{{"accuracy", r.accuracy}, {"error", 1 - r.accuracy}, {"loss", r.loss}, {"examples", r.examples}},
                 fmt::format("{} loss {:.4f} accuracy {:.2f}% ({} images)", split, r.loss, 100 * r.accuracy,
                             r.examples)};
    keep = std::move(r);
    return e;
  }

  const TrainOptions& o_;
  const data::ImageSet& train_;
  const data::ImageSet* val_;
  const data::ImageSet* test_;
  models::CapsNet model_{nullptr};
};

}  // namespace

void TrainOptions::validate() const {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  model.validate();
  loop.validate();  // throws naming the value (also a CPU without bf16 for precision)
  if (validation_size < 0) fail(fmt::format("validation_size must be >= 0 (0 = none), got {}", validation_size));
  if (eval_batch_size <= 0) fail(fmt::format("eval_batch_size must be positive, got {}", eval_batch_size));
  if (max_shift < 0 || max_shift >= model.image_size)
    fail(fmt::format("max_shift must be in [0, {}), got {}", model.image_size, max_shift));
}

nlohmann::json TrainOptions::to_json() const {
  auto j = loop.to_json();
  j["max_shift"] = max_shift;
  return j;
}

TrainResult train(const TrainOptions& options, const data::ImageSet& train_set, const data::ImageSet* test_set,
                  std::ostream& log, std::shared_ptr<ProcessGroup> group) {
  options.validate();
  if (train_set.size() == 0) throw std::invalid_argument("training set is empty");
  if (train_set.height() != options.model.image_size || train_set.width() != options.model.image_size ||
      train_set.channels() != options.model.image_channels)
    throw std::invalid_argument(fmt::format("training images are {}x{} with {} channel(s) but the model expects {}x{} with {}",
                                            train_set.width(), train_set.height(), train_set.channels(),
                                            options.model.image_size, options.model.image_size,
                                            options.model.image_channels));
  if (!train_set.class_names.empty() && static_cast<int64_t>(train_set.class_names.size()) != options.model.num_classes)
    throw std::invalid_argument(fmt::format("the training set has {} classes but the model has {} (num_classes)",
                                            train_set.class_names.size(), options.model.num_classes));
  if (options.validation_size >= train_set.size())
    throw std::invalid_argument(fmt::format("validation_size {} leaves no training examples of {}",
                                            options.validation_size, train_set.size()));
  // The split: the first n - V examples train, the last V validate (a fixed split, the same for every seed).
  const auto [fit, val] = data::split_tail(train_set, options.validation_size);
  ClassificationTask task(options, fit, options.validation_size > 0 ? &val : nullptr, test_set);
  auto r = run(task, options.loop, log, std::move(group));
  TrainResult result;
  result.start_step = r.start_step;
  result.end_step = r.end_step;
  result.seconds = r.seconds;
  result.images_per_second = r.images_per_second;
  result.losses = std::move(r.losses);
  result.test = std::move(task.last_);
  result.validation = std::move(task.last_validation_);
  result.best_validation_accuracy = r.best_validation_accuracy;
  result.best_validation_step = r.best_validation_step;
  result.checkpoint = r.checkpoint;
  return result;
}

}  // namespace capsnet::train
