#include "capsnet/train/classifier_task.h"

#include <fmt/format.h>

#include <iostream>
#include <stdexcept>

#include "capsnet/data/transforms.h"
#include "capsnet/train/metrics.h"

namespace capsnet::train {
namespace {

torch::Tensor accuracy_of(const torch::Tensor& predicted, const torch::Tensor& labels) {
  return predicted.detach().eq(labels).to(torch::kFloat64).mean();
}

// What every classifier shares: name, module, config, evaluation (evaluate.h) and the spatial transformer;
// the factories add the loss and the prediction.
template <class Model, class Config>
Classifier classifier_of(const std::string& name, Model model, const Config& config) {
  Classifier c;
  c.name = name;
  c.module = model.ptr();
  c.config = config.to_json();
  c.evaluate = [model](const data::ImageSet& set, int64_t batch_size, std::ostream* progress) mutable {
    return train::evaluate(model, set, batch_size, progress);
  };
  if (model->stn)
    c.transformer = [model](const torch::Tensor& images) mutable { return model->stn->forward_with_theta(images); };
  return c;
}

}  // namespace

Classifier capsnet_classifier(const std::string& name, const models::CapsNetConfig& config, Precision precision,
                              bool fused_routing) {
  config.validate();
  models::CapsNet model(config);
  model->set_fused_routing(fused_routing);
  model->set_precision(precision);
  auto c = classifier_of(name, model, config);
  c.config_matches = [config](const nlohmann::json& saved) { return models::same_config(saved, config); };
  c.loss = [model](const torch::Tensor& images, const torch::Tensor& labels) mutable {
    auto out = model(images, labels);
    auto l = model->loss(out, images, labels);  // margin + scale * SSE against the (untransformed) input
    return TaskLoss{l.total,
                    {{"margin_loss", l.margin},
                     {"reconstruction_loss", l.reconstruction},
                     {"accuracy", accuracy_of(out.lengths.argmax(1), labels)}}};
  };
  c.predict = [model](const torch::Tensor& images) mutable { return model(images).lengths.argmax(1); };
  return c;
}

Classifier cnn_classifier(const std::string& name, const models::BaselineCnnConfig& config, Precision precision) {
  config.validate();
  models::BaselineCnn model(config);
  model->set_precision(precision);
  auto c = classifier_of(name, model, config);
  c.loss = [model](const torch::Tensor& images, const torch::Tensor& labels) mutable {
    auto logits = model(images);  // [B, K]
    return TaskLoss{model->loss(logits, labels), {{"accuracy", accuracy_of(logits.argmax(1), labels)}}};
  };
  c.predict = [model](const torch::Tensor& images) mutable { return model(images).argmax(1); };
  return c;
}

ClassifierTask::ClassifierTask(std::string name, std::function<Classifier(Precision)> make, int64_t epoch_size,
                               bool shuffle, LabelledBatchSource source, nlohmann::json data_config,
                               ClassifierEvaluator evaluator)
    : name_(std::move(name)),
      make_(std::move(make)),
      epoch_size_(epoch_size),
      shuffle_(shuffle),
      source_(std::move(source)),
      data_config_(std::move(data_config)),
      evaluator_(std::move(evaluator)) {}

std::shared_ptr<torch::nn::Module> ClassifierTask::build_model(Precision precision) {
  classifier_ = make_(precision);
  return classifier_.module;
}

bool ClassifierTask::config_matches(const nlohmann::json& saved) const {
  return classifier_.config_matches ? classifier_.config_matches(saved) : saved == classifier_.config;
}

std::optional<Evaluation> ClassifierTask::evaluate(std::ostream* progress) {
  if (!evaluator_) return std::nullopt;
  return evaluator_(classifier_, progress);
}

std::optional<Evaluation> ClassifierTask::evaluate_validation(std::ostream* progress) {
  if (!validator_) return std::nullopt;
  return validator_(classifier_, progress);
}

Batch ClassifierTask::batch(const torch::Tensor& ids, at::Generator& gen) const {
  auto [images, labels] = source_(ids, gen);
  return {{images, labels}};  // [B, C, S, S], [B]
}

double classifier_accuracy(Classifier& c, const data::ImageSet& set, int64_t batch_size, std::ostream* progress,
                           const std::string& label) {
  if (batch_size < 1) throw std::invalid_argument(fmt::format("batch_size must be positive, got {}", batch_size));
  torch::NoGradGuard no_grad;
  const bool was_training = c.module->is_training();
  c.module->eval();
  int64_t correct = 0;
  ProgressBar bar(progress ? *progress : std::cerr, c.name + " " + label, set.size(), progress != nullptr);
  for (int64_t start = 0; start < set.size(); start += batch_size) {
    const int64_t len = std::min(batch_size, set.size() - start);
    auto images = data::to_float(set.images.narrow(0, start, len));  // [len, 1, S, S]
    correct += c.predict(images).eq(set.labels.narrow(0, start, len)).sum().item<int64_t>();
    bar.update(start + len, "");
  }
  const double acc = set.size() ? static_cast<double>(correct) / static_cast<double>(set.size()) : 0.0;
  bar.finish(fmt::format("accuracy {:.2f}%", 100 * acc));
  c.module->train(was_training);
  return acc;
}

ClassifierEvaluator accuracy_evaluator(const data::ImageSet& set, const std::string& split, const std::string& label,
                                       int64_t batch_size) {
  return [&set, split, label, batch_size](Classifier& c, std::ostream* progress) {
    const double acc = classifier_accuracy(c, set, batch_size, progress, label);
    return Evaluation{{{"split", split}, {"accuracy", acc}, {"error", 1 - acc}, {"examples", set.size()}},
                      fmt::format("{} accuracy {:.2f}% ({} images)", label, 100 * acc, set.size())};
  };
}

ClassifierEvaluator loss_evaluator(const data::ImageSet& set, const std::string& label, int64_t batch_size,
                                   std::optional<EvalResult>* last) {
  return [&set, label, batch_size, last](Classifier& c, std::ostream* progress) {
    auto r = c.evaluate(set, batch_size, progress);
    Evaluation e{
        {{"accuracy", r.accuracy}, {"error", 1 - r.accuracy}, {"loss", r.loss}, {"examples", r.examples}},
        fmt::format("{} loss {:.4f} accuracy {:.2f}% ({} images)", label, r.loss, 100 * r.accuracy, r.examples)};
    if (last) *last = std::move(r);
    return e;
  };
}

LabelledBatchSource shifted_batches(const data::ImageSet& set, int64_t max_shift, bool hflip) {
  return [&set, max_shift, hflip](const torch::Tensor& ids, at::Generator& gen) {
    auto images = data::random_shift(data::to_float(set.images.index_select(0, ids)), max_shift, gen);
    if (hflip) images = data::random_hflip(images, gen);
    return std::make_pair(images, set.labels.index_select(0, ids));  // [B, C, S, S], [B]
  };
}

}  // namespace capsnet::train
