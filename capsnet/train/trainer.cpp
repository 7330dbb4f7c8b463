#include "capsnet/train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <iostream>

#include "capsnet/train/classifier_task.h"

namespace capsnet::train {

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
  j["hflip"] = hflip;
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
    throw std::invalid_argument(
        fmt::format("validation_size {} leaves no training examples of {}", options.validation_size, train_set.size()));
  // The split: the first n - V examples train, the last V validate (a fixed split, the same for every seed).
  const auto [fit, val] = data::split_tail(train_set, options.validation_size);
  // The paper's MNIST experiment (and any labelled image set): CapsNet on randomly shifted images.
  nlohmann::json data_config = {{"max_shift", options.max_shift}, {"train_examples", fit.size()}};
  if (options.validation_size > 0) data_config["validation_size"] = val.size();  // only then: older runs resume
  // Always: a resume compares the keys both runs have, so a checkpoint from before --hflip resumes.
  data_config["hflip"] = options.hflip;
  // Only when present, so the resume check of a run that predates them still matches.
  if (!fit.class_names.empty()) data_config["classes"] = fit.class_names;
  for (const auto& [key, value] : options.data_info.items()) data_config[key] = value;
  std::optional<EvalResult> last_test, last_validation;  // for the result
  ClassifierTask task(
      "classification",
      [&options](Precision precision) {
        return capsnet_classifier("CapsNet", options.model, precision, options.fused_routing);
      },
      fit.size(), /*shuffle=*/true, shifted_batches(fit, options.max_shift, options.hflip), std::move(data_config),
      test_set ? loss_evaluator(*test_set, "test", options.eval_batch_size, &last_test) : ClassifierEvaluator{});
  if (options.validation_size > 0)
    task.set_validation(loss_evaluator(val, "val", options.eval_batch_size, &last_validation));
  auto r = run(task, options.loop, log, std::move(group));
  return TrainResult{
      RunStats::of(r),       r.start_step, std::move(last_test), std::move(last_validation), r.best_validation_accuracy,
      r.best_validation_step};
}

}  // namespace capsnet::train
