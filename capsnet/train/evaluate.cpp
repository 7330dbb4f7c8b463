#include "capsnet/train/evaluate.h"

#include <fmt/format.h>

#include <functional>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#include "capsnet/data/transforms.h"
#include "capsnet/train/metrics.h"

namespace capsnet::train {

namespace {

// One batch's predictions [len] and its loss summed over the batch.
using BatchScorer = std::function<std::pair<torch::Tensor, double>(const torch::Tensor& images,
                                                                   const torch::Tensor& labels)>;

// The batched loop of evaluate for a model of K classes (eval mode and no gradients set by the caller).
EvalResult evaluate_batches(const data::ImageSet& set, int64_t K, int64_t batch_size, std::ostream* progress,
                            const BatchScorer& score) {
  TORCH_CHECK(batch_size > 0, "evaluate: batch size must be positive, got ", batch_size);
  const int64_t n = set.size();
  EvalResult r;
  r.examples = n;
  r.confusion = torch::zeros({K, K}, torch::kLong);
  if (n > 0) {
    // A model for fewer classes than the data has (e.g. a crafted checkpoint) must say so, not
    // fail inside index_put_.
    const int64_t lo = set.labels.min().item<int64_t>(), hi = set.labels.max().item<int64_t>();
    if (lo < 0 || hi >= K)
      throw std::invalid_argument(fmt::format("evaluate: the data has labels {}..{} but the model has {} classes "
                                              "(0..{})",
                                              lo, hi, K, K - 1));
  }
  double loss_sum = 0;
  ProgressBar bar(progress ? *progress : std::cerr, "eval", n, progress != nullptr);
  for (int64_t start = 0; start < n; start += batch_size) {
    const int64_t len = std::min(batch_size, n - start);
    auto images = data::to_float(set.images.narrow(0, start, len));  // [len, C, S, S]
    auto labels = set.labels.narrow(0, start, len);                  // [len]
    auto [pred, loss] = score(images, labels);
    r.confusion.index_put_({labels, pred}, torch::ones({len}, torch::kLong), /*accumulate=*/true);
    loss_sum += loss;
    bar.update(start + len, "");
  }
  r.accuracy = n ? static_cast<double>(r.confusion.diag().sum().item<int64_t>()) / static_cast<double>(n) : 0.0;
  r.loss = n ? loss_sum / static_cast<double>(n) : 0.0;
  bar.finish(fmt::format("accuracy {:.2f}%", 100 * r.accuracy));
  return r;
}

// Puts modules in eval mode for its lifetime and restores each one's mode afterwards (also on a throw).
class EvalModeGuard {
 public:
  explicit EvalModeGuard(std::vector<torch::nn::Module*> modules) : modules_(std::move(modules)) {
    for (auto* m : modules_) {
      was_training_.push_back(m->is_training());
      m->eval();
    }
  }
  ~EvalModeGuard() {
    for (size_t i = 0; i < modules_.size(); ++i) modules_[i]->train(was_training_[i]);
  }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  std::vector<torch::nn::Module*> modules_;
  std::vector<bool> was_training_;
};

// Runs `body` with `model` in eval mode and no gradients, restoring its mode afterwards.
template <class F>
EvalResult in_eval_mode(torch::nn::Module& model, F&& body) {
  torch::NoGradGuard no_grad;
  const EvalModeGuard eval_mode({&model});
  return body();
}

}  // namespace

EvalResult evaluate(models::CapsNet& model, const data::ImageSet& set, int64_t batch_size,
                    std::ostream* progress) {
  return in_eval_mode(*model, [&] {
    return evaluate_batches(set, model->config.num_classes, batch_size, progress,
                            [&](const torch::Tensor& images, const torch::Tensor& labels) {
                              auto out = model(images);  // decoder sees the predicted capsule, as at inference
                              const double len = static_cast<double>(images.size(0));
                              return std::make_pair(out.lengths.argmax(1),
                                                    model->loss(out, images, labels).total.item<double>() * len);
                            });
  });
}

EnsembleResult evaluate_ensemble(std::vector<models::CapsNet>& models, const data::ImageSet& set,
                                 int64_t batch_size, std::ostream* progress) {
  if (models.empty()) throw std::invalid_argument("evaluate_ensemble: no models");
  const int64_t K = models.front()->config.num_classes;
  for (size_t m = 1; m < models.size(); ++m)
    if (models[m]->config.num_classes != K)
      throw std::invalid_argument(fmt::format("evaluate_ensemble: model {} has {} classes, model 0 has {}", m,
                                              models[m]->config.num_classes, K));
  torch::NoGradGuard no_grad;
  std::vector<torch::nn::Module*> modules;
  for (auto& model : models) modules.push_back(model.ptr().get());
  std::vector<int64_t> correct(models.size(), 0);
  EnsembleResult r;
  {
    const EvalModeGuard eval_mode(modules);
    r.ensemble = evaluate_batches(set, K, batch_size, progress, [&](const torch::Tensor& images,
                                                                    const torch::Tensor& labels) {
      torch::Tensor sum;  // sum: [len, K], the models' capsule lengths added up
      for (size_t m = 0; m < models.size(); ++m) {
        const auto lengths = models[m](images).lengths.to(torch::kFloat);  // [len, K]
        correct[m] += lengths.argmax(1).eq(labels).sum().item<int64_t>();
        sum = sum.defined() ? sum.add_(lengths) : lengths.clone();
      }
      return std::make_pair(sum.argmax(1), 0.0);
    });
  }
  r.ensemble.loss = std::numeric_limits<double>::quiet_NaN();
  const double n = static_cast<double>(std::max<int64_t>(set.size(), 1));
  for (const int64_t c : correct) r.member_accuracy.push_back(static_cast<double>(c) / n);
  return r;
}

EvalResult evaluate(models::BaselineCnn& model, const data::ImageSet& set, int64_t batch_size,
                    std::ostream* progress) {
  return in_eval_mode(*model, [&] {
    return evaluate_batches(set, model->config.num_classes, batch_size, progress,
                            [&](const torch::Tensor& images, const torch::Tensor& labels) {
                              auto logits = model(images);  // [len, K]
                              const double len = static_cast<double>(images.size(0));
                              return std::make_pair(logits.argmax(1),
                                                    model->loss(logits, labels).item<double>() * len);
                            });
  });
}

std::string format_confusion(const torch::Tensor& confusion) {
  const int64_t K = confusion.size(0);
  auto c = confusion.accessor<int64_t, 2>();
  std::string s = "true\\pred";
  for (int64_t j = 0; j < K; ++j) s += fmt::format("{:>6}", j);
  s += "    acc\n";
  for (int64_t i = 0; i < K; ++i) {
    s += fmt::format("{:>9}", i);
    int64_t row = 0;
    for (int64_t j = 0; j < K; ++j) {
      s += fmt::format("{:>6}", c[i][j]);
      row += c[i][j];
    }
    s += row ? fmt::format(" {:>6.2f}%\n", 100.0 * static_cast<double>(c[i][i]) / static_cast<double>(row))
             : "      -\n";
  }
  return s;
}

}  // namespace capsnet::train
