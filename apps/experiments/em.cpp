#include "apps/experiments/em.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "capsnet/data/transforms.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/nn/em_routing.h"
#include "capsnet/train/metrics.h"

namespace capsnet::experiments {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void EmTrainOptions::validate() const {
  model.validate();
  auto positive = [](int64_t v, const char* name) {
    if (v < 1) throw std::invalid_argument(fmt::format("em: {} must be >= 1, got {}", name, v));
  };
  positive(loop.max_steps, "steps");
  positive(eval_batch_size, "eval_batch_size");
  loop.validate();
  if (!(margin_start >= 0) || !(margin_end >= 0))
    throw std::invalid_argument(fmt::format("em: margins must be >= 0, got {} and {}", margin_start, margin_end));
  if (train_size < 0) throw std::invalid_argument(fmt::format("em: train_size must be >= 0, got {}", train_size));
  if (test_size < 0) throw std::invalid_argument(fmt::format("em: test_size must be >= 0, got {}", test_size));
  if (max_shift < 0 || max_shift >= model.image_size)
    throw std::invalid_argument(
        fmt::format("em: max_shift must be in [0, {}) (the image side), got {}", model.image_size, max_shift));
}

nlohmann::json EmTrainOptions::to_json() const {
  return {{"out_dir", loop.out_dir},      {"steps", loop.max_steps}, {"batch_size", loop.batch_size},
          {"lr", loop.lr},                {"weight_decay", loop.weight_decay}, {"lr_decay", loop.lr_decay},
          {"margin_start", margin_start},
          {"margin_end", margin_end},     {"max_shift", max_shift}, {"seed", loop.seed},      {"train_size", train_size},
          {"test_size", test_size},       {"eval_batch_size", eval_batch_size}, {"log_every", loop.log_every},
          {"checkpoint_every", loop.checkpoint_every}, {"eval_every", loop.eval_every},
          {"max_seconds", loop.max_seconds}, {"precision", precision_name(loop.precision)}};
}

torch::Tensor to_input(const torch::Tensor& images) {
  return images.to(torch::kFloat).div(255.0).unsqueeze(1);  // [N, 1, H, W]
}

EmEval evaluate_em(models::MatrixCapsNet& model, const data::ImageSet& set, int64_t count, int64_t batch_size,
                   double margin, std::ostream* progress) {
  const auto t0 = Clock::now();
  const int64_t n = (count <= 0 || count > set.size()) ? set.size() : count;
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  train::ProgressBar bar(progress ? *progress : std::cerr, "eval", n, progress != nullptr);
  int64_t correct = 0;
  double loss_sum = 0;
  const int64_t K = model->config.num_classes;
  auto confusion = torch::zeros({K * K}, torch::kLong);  // flattened [K, K]
  for (int64_t start = 0; start < n; start += batch_size) {
    const int64_t len = std::min(batch_size, n - start);
    auto images = to_input(set.images.narrow(0, start, len));
    auto labels = set.labels.narrow(0, start, len).to(torch::kLong);
    auto out = model->forward(images);  // activations: [len, classes]
    const auto predicted = out.activations.argmax(1);
    correct += predicted.eq(labels).sum().item<int64_t>();
    confusion.index_add_(0, labels * K + predicted, torch::ones({len}, torch::kLong));
    loss_sum += spread_loss(out.activations, labels, margin).item<double>() * len;
    bar.update(start + len, fmt::format("accuracy {:.2f}%", 100.0 * correct / (start + len)));
  }
  EmEval r;
  r.examples = n;
  r.accuracy = n ? double(correct) / n : 0;
  r.loss = n ? loss_sum / n : 0;
  r.seconds = train::seconds_since(t0);
  r.confusion = confusion.view({K, K});
  bar.finish(fmt::format("accuracy {:.2f}% (error {:.2f}%)", 100 * r.accuracy, 100 * (1 - r.accuracy)));
  if (was_training) model->train();
  return r;
}

namespace {

/// Matrix capsules with EM routing as a train::Task: shuffled MNIST, the spread loss with its margin
/// annealed linearly over the run's steps.
class EmTask : public train::Task {
 public:
  EmTask(const EmTrainOptions& o, const data::ImageSet& train_set, const data::ImageSet* test_set)
      : o_(o), train_(train_set), test_(test_set) {}

  std::string name() const override { return "em"; }
  std::shared_ptr<torch::nn::Module> build_model(Precision precision) override {
    model_ = models::MatrixCapsNet(o_.model);
    model_->set_precision(precision);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return o_.model.to_json(); }
  // Through from_json: an older checkpoint lacks the new routing keys and means the
  // legacy routing, so it resumes only into a run configured that way.
  bool config_matches(const nlohmann::json& saved) const override {
    try {
      return models::MatrixCapsNetConfig::from_json(saved).to_json() == model_config();
    } catch (const std::invalid_argument&) {
      return false;
    }
  }
  nlohmann::json data_config() const override {
    // A checkpoint from before max_shift lacks the key; the resume check skips keys one side lacks.
    return {{"train_examples", train_.size()},
            {"margin_start", o_.margin_start},
            {"margin_end", o_.margin_end},
            {"max_shift", o_.max_shift}};
  }
  std::string describe() const override {
    const auto sides = o_.model.grid_sides();
    const auto& m = o_.model;
    const auto lambdas = m.routing().inverse_temperature;
    std::string lambda_text;
    for (const double l : lambdas) lambda_text += fmt::format("{}{:.6g}", lambda_text.empty() ? "" : " ", l);
    return fmt::format("matrix capsules (EM routing): A={} B={} C={} D={}, capsule grids {}x{} -> {}x{} -> {}x{}, {} "
                       "routing iterations, lambda {} ({}), logit offset {} lambda, R over {}, {} cost{}",
                       m.conv1_channels, m.primary_types, m.conv1_caps_types, m.conv2_caps_types, sides[0], sides[0],
                       sides[1], sides[1], sides[2], sides[2], m.routing_iterations, m.lambda_schedule, lambda_text,
                       m.logit_offset_outside_lambda ? "outside" : "inside",
                       m.cross_window_routing ? "all windows of a child" : "each window",
                       m.normalize_cost ? "normalised" : "paper",
                       m.standardize_cost ? ", standardised over parents" : "");
  }
  int64_t epoch_size() const override { return train_.size(); }
  void begin_step(int64_t step, int64_t total_steps) override {
    margin_ = spread_margin(step, total_steps, o_.margin_start, o_.margin_end);
  }
  train::Batch batch(const torch::Tensor& ids, at::Generator& gen) const override {
    auto images = to_input(train_.images.index_select(0, ids));  // [B, 1, S, S]
    // The loop's generator: the shifts are part of the exactly resumed state.
    if (o_.max_shift > 0) images = data::random_shift(images, o_.max_shift, gen);
    return {{images, train_.labels.index_select(0, ids)}};  // [B, 1, S, S], [B]
  }
  train::TaskLoss loss(const train::Batch& rows) override {
    const auto& labels = rows[1];
    auto out = model_->forward(rows[0]);  // activations: [B, classes]
    auto loss = spread_loss(out.activations, labels, margin_);
    auto accuracy = out.activations.detach().argmax(1).eq(labels).to(torch::kFloat64).mean();
    return {loss, {{"margin", torch::tensor(margin_, torch::kFloat64)}, {"accuracy", accuracy}}};
  }
  std::optional<train::Evaluation> evaluate(std::ostream* progress) override {
    if (!test_ || o_.test_size == 0) return std::nullopt;
    last_ = evaluate_em(model_, *test_, o_.test_size, o_.eval_batch_size, o_.margin_end, progress);
    const auto& r = last_;
    return train::Evaluation{{{"accuracy", r.accuracy},
                       {"error", 1 - r.accuracy},
                       {"loss", r.loss},
                       {"examples", r.examples},
                       {"seconds", r.seconds}},
                      fmt::format("test accuracy {:.2f}% ({} images)", 100 * r.accuracy, r.examples)};
  }

  EmEval last_;
  models::MatrixCapsNet model_{nullptr};

 private:
  const EmTrainOptions& o_;
  const data::ImageSet& train_;
  const data::ImageSet* test_;
  double margin_ = 0;
};

}  // namespace

EmTrainResult train_em(const EmTrainOptions& options, const data::ImageSet& train_full, const data::ImageSet* test_set,
                       std::ostream& log, std::shared_ptr<train::ProcessGroup> group) {
  options.validate();
  const auto train_set = data::take(train_full, options.train_size);
  if (train_set.images.size(1) != options.model.image_size || train_set.images.size(2) != options.model.image_size)
    throw std::invalid_argument(fmt::format("em: the images are {}x{}, the model takes {}x{}",
                                            train_set.images.size(1), train_set.images.size(2),
                                            options.model.image_size, options.model.image_size));
  EmTask task(options, train_set, test_set);
  auto r = train::run(task, options.loop, log, std::move(group));
  EmTrainResult result{train::RunStats::of(r), task.model_, 0.0, task.last_};
  // Training accuracy over the last log_every steps (what the last "train" record shows).
  const auto tail = std::min<size_t>(r.accuracies.size(), static_cast<size_t>(options.loop.log_every));
  for (size_t i = r.accuracies.size() - tail; i < r.accuracies.size(); ++i)
    result.final_train_accuracy += r.accuracies[i] / static_cast<double>(tail);
  return result;
}

}  // namespace capsnet::experiments
