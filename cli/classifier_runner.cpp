#include "cli/classifier_runner.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>

#include "capsnet/data/transforms.h"
#include "capsnet/train/trainer.h"

namespace capsnet::cli {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

ClassifierRunner capsnet_classifier(const std::string& name, const models::CapsNetConfig& config, double lr,
                                    uint64_t seed) {
  config.validate();
  torch::manual_seed(seed);
  models::CapsNet model(config);
  auto opt = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(lr));
  ClassifierRunner r;
  r.name = name;
  r.parameters = models::count_parameters(*model);
  r.config = config.to_json();
  r.set_training = [model](bool on) mutable { on ? model->train() : model->eval(); };
  r.step = [model, opt](const torch::Tensor& images, const torch::Tensor& labels) mutable {
    auto out = model(images, labels);
    auto loss = model->loss(out, images, labels);  // margin + scale * SSE against the untransformed input
    opt->zero_grad();
    loss.total.backward();
    opt->step();
    return std::make_pair(loss.total.item<double>(), out.lengths.argmax(1).eq(labels).sum().item<int64_t>());
  };
  r.predict = [model](const torch::Tensor& images) mutable { return model(images).lengths.argmax(1); };
  if (model->stn)
    r.transformer = [model](const torch::Tensor& images) mutable { return model->stn->forward_with_theta(images); };
  return r;
}

ClassifierRunner cnn_classifier(const std::string& name, const models::BaselineCnnConfig& config, double lr,
                                uint64_t seed) {
  config.validate();
  torch::manual_seed(seed);
  models::BaselineCnn model(config);
  auto opt = std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(lr));
  ClassifierRunner r;
  r.name = name;
  r.parameters = models::count_parameters(*model);
  r.config = config.to_json();
  r.set_training = [model](bool on) mutable { on ? model->train() : model->eval(); };
  r.step = [model, opt](const torch::Tensor& images, const torch::Tensor& labels) mutable {
    auto logits = model(images);              // [B, K]
    auto loss = model->loss(logits, labels);  // cross-entropy
    opt->zero_grad();
    loss.backward();
    opt->step();
    return std::make_pair(loss.item<double>(), logits.argmax(1).eq(labels).sum().item<int64_t>());
  };
  r.predict = [model](const torch::Tensor& images) mutable { return model(images).argmax(1); };
  if (model->stn)
    r.transformer = [model](const torch::Tensor& images) mutable { return model->stn->forward_with_theta(images); };
  return r;
}

TrainingStats run_training(ClassifierRunner& r, int64_t steps,
                           const std::function<std::pair<torch::Tensor, torch::Tensor>(int64_t)>& batch,
                           int64_t log_every, bool progress, train::JsonLinesWriter& metrics) {
  TrainingStats s;
  const int64_t tail = std::max<int64_t>(1, steps / 10);
  double tail_loss = 0, win_loss = 0;
  int64_t tail_correct = 0, tail_seen = 0, win_correct = 0, win_seen = 0, win_steps = 0;
  r.set_training(true);
  train::ProgressBar bar(std::cerr, r.name + " train", steps, progress);
  for (int64_t step = 0; step < steps; ++step) {
    auto [images, labels] = batch(step);
    const int64_t b = labels.size(0);
    const auto t0 = Clock::now();  // the model's time only, not the data generation
    auto [loss, correct] = r.step(images, labels);
    s.seconds += seconds_since(t0);
    if (!std::isfinite(loss))
      throw train::TrainingDiverged(fmt::format("{}: loss is {} at step {}; try a lower --lr", r.name, loss, step));
    s.steps = step + 1;
    s.images += b;
    win_loss += loss, win_correct += correct, win_seen += b, ++win_steps;
    if (step >= steps - tail) tail_loss += loss, tail_correct += correct, tail_seen += b;
    const double img_s = s.seconds > 0 ? static_cast<double>(s.images) / s.seconds : 0;
    bar.update(s.steps, fmt::format("loss {:.4f} {:.0f} img/s", loss, img_s));
    if (s.steps % log_every == 0 || s.steps == steps) {
      metrics.write({{"event", "train"},
                     {"model", r.name},
                     {"step", s.steps},
                     {"loss", win_loss / win_steps},
                     {"accuracy", static_cast<double>(win_correct) / win_seen},
                     {"images_per_second", img_s}});
      win_loss = 0, win_correct = win_seen = win_steps = 0;
    }
  }
  s.final_loss = tail_loss / tail;
  s.final_accuracy = tail_seen ? static_cast<double>(tail_correct) / tail_seen : 0.0;
  bar.finish(fmt::format("last {} steps: loss {:.4f} acc {:.2f}%", tail, s.final_loss, 100 * s.final_accuracy));
  r.set_training(false);
  return s;
}

double classifier_accuracy(ClassifierRunner& r, const data::ImageSet& set, int64_t batch_size, bool progress,
                           const std::string& label) {
  torch::NoGradGuard no_grad;
  r.set_training(false);
  int64_t correct = 0;
  train::ProgressBar bar(std::cerr, r.name + " " + label, set.size(), progress);
  for (int64_t start = 0; start < set.size(); start += batch_size) {
    const int64_t len = std::min(batch_size, set.size() - start);
    auto images = data::to_float(set.images.narrow(0, start, len));  // [len, 1, S, S]
    correct += r.predict(images).eq(set.labels.narrow(0, start, len)).sum().item<int64_t>();
    bar.update(start + len, "");
  }
  const double acc = set.size() ? static_cast<double>(correct) / static_cast<double>(set.size()) : 0.0;
  bar.finish(fmt::format("accuracy {:.2f}%", 100 * acc));
  return acc;
}

}  // namespace capsnet::cli
