#include "apps/experiments/multimnist.h"

#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <memory>
#include <cmath>
#include <stdexcept>

#include "capsnet/train/metrics.h"
#include "capsnet/viz/figures.h"

namespace capsnet::experiments {
namespace {

using Clock = std::chrono::steady_clock;

// The lr decays per 60,000 pairs, the size of an MNIST epoch, so that the schedule does not depend on
// the batch size and matches `capsnet train` image for image.
constexpr double kDecayImages = 60000.0;

// Works for either model's config (both have image_channels and image_size).
template <class Config>
void check_pairs_fit(const Config& config, const data::MultiMnist& pairs, const char* what) {
  if (config.image_channels != 1 || config.image_size != pairs.canvas_size())
    throw std::invalid_argument(fmt::format("{} pairs are 1x{}x{} but the model expects {}x{}x{}", what,
                                            pairs.canvas_size(), pairs.canvas_size(), config.image_channels,
                                            config.image_size, config.image_size));
}

/// Scores [B, K] (capsule lengths or logits) and the mean loss of one batch of pairs.
using PairScorer = std::function<std::pair<torch::Tensor, double>(const data::MultiMnistBatch&)>;

// The evaluation both models share: the paper's metric on the scores, per-digit hits, mean loss, overlap.
MultiMnistEval evaluate_pairs(torch::nn::Module& model, const data::MultiMnist& pairs, int64_t count,
                              int64_t batch_size, std::ostream* progress, const PairScorer& score) {
  if (count < 1 || batch_size < 1)
    throw std::invalid_argument(fmt::format("evaluate_multimnist: count and batch size must be >= 1, got {} and {}",
                                            count, batch_size));
  const auto t0 = Clock::now();
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  MultiMnistEval r;
  int64_t correct = 0, digits_found = 0;
  double loss_sum = 0;
  train::ProgressBar bar(progress ? *progress : std::cerr, "eval", count, progress != nullptr);
  for (int64_t start = 0; start < count; start += batch_size) {
    const int64_t len = std::min(batch_size, count - start);
    auto batch = pairs.generate(start, len);
    auto [scores, loss] = score(batch);  // [B, K], mean over the batch
    correct += both_found(scores, batch.labels).sum().item<int64_t>();
    auto top = two_longest(scores);  // [B, 2]
    // A label counts as found when it is one of the two top scores.
    digits_found += (top.unsqueeze(1).eq(batch.labels.unsqueeze(2))).any(2).sum().item<int64_t>();
    loss_sum += loss * static_cast<double>(len);
    data::accumulate_overlap(r.overlap, batch.digits);
    bar.update(start + len, fmt::format("both found {:.2f}%", 100.0 * correct / (start + len)));
  }
  r.examples = count;
  r.accuracy = static_cast<double>(correct) / static_cast<double>(count);
  r.digit_accuracy = static_cast<double>(digits_found) / static_cast<double>(2 * count);
  r.loss = loss_sum / static_cast<double>(count);
  r.seconds = train::seconds_since(t0);
  bar.finish(fmt::format("both found {:.2f}% (error {:.2f}%)", 100 * r.accuracy, 100 * (1 - r.accuracy)));
  if (was_training) model.train();
  return r;
}

}  // namespace

const char* multimnist_model_name(MultiMnistModel model) {
  return model == MultiMnistModel::kCnn ? "cnn" : "capsnet";
}

MultiMnistModel parse_multimnist_model(const std::string& name) {
  if (name == "capsnet") return MultiMnistModel::kCapsNet;
  if (name == "cnn") return MultiMnistModel::kCnn;
  throw std::invalid_argument(fmt::format("multimnist: the model must be capsnet or cnn, got '{}'", name));
}

void MultiMnistTrainOptions::validate() const {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (which == MultiMnistModel::kCnn) {
    cnn.validate();
    if (cnn.num_classes < 2) fail("multimnist: the model needs at least 2 classes");
  } else {
    model.validate();
    if (model.num_classes < 2) fail("multimnist: the model needs at least 2 classes");
  }
  if (loop.eval_every < 0) fail(fmt::format("eval_every must be >= 0, got {}", loop.eval_every));
  if (loop.max_steps <= 0) fail(fmt::format("steps must be positive, got {}", loop.max_steps));
  if (eval_batch_size <= 0) fail(fmt::format("eval_batch_size must be positive, got {}", eval_batch_size));
  if (test_size < 0) fail(fmt::format("test_size must be >= 0, got {}", test_size));
  loop.validate();
}

nlohmann::json MultiMnistTrainOptions::to_json() const {
  return {{"task", "multimnist"}, {"model", multimnist_model_name(which)}, {"steps", loop.max_steps},
          {"batch_size", loop.batch_size}, {"lr", loop.lr}, {"lr_decay", loop.lr_decay}, {"seed", loop.seed},
          {"test_size", test_size}, {"out_dir", loop.out_dir}};
}

data::Overlay saved_overlay(const nlohmann::json& train_options) {
  if (!train_options.is_object() || !train_options.contains("train_generator")) return data::Overlay::kMax;
  const auto& generator = train_options.at("train_generator");
  if (!generator.is_object() || !generator.contains("overlay")) return data::Overlay::kMax;
  if (!generator.at("overlay").is_string())
    throw std::invalid_argument("checkpoint: train_generator.overlay must be a string");
  return data::parse_overlay(generator.at("overlay").get<std::string>());
}

MultiMnistForward forward_pair(models::CapsNet& model, const torch::Tensor& images, const torch::Tensor& which) {
  TORCH_CHECK(which.dim() == 2 && which.size(1) == 2 && which.size(0) == images.size(0),
              "forward_pair: which must be [B, 2] with B = ", images.size(0), ", got ", which.sizes());
  MultiMnistForward f;
  // forward() already decodes the capsule it is given; the second digit costs one more decoder pass only.
  f.out = model->forward(images, which.select(1, 0));
  if (f.out.reconstruction.defined()) {
    auto rec_b = model->decode(f.out.digit_caps, which.select(1, 1));   // [B, C*S*S]
    f.reconstructions = torch::stack({f.out.reconstruction, rec_b}, 1);  // [B, 2, C*S*S]
  }
  return f;
}

MultiMnistLoss multimnist_loss(const models::CapsNetConfig& config, const MultiMnistForward& f,
                               const torch::Tensor& labels, const torch::Tensor& digits) {
  const auto& lengths = f.out.lengths;  // [B, K]
  TORCH_CHECK(labels.dim() == 2 && labels.size(1) == 2 && labels.size(0) == lengths.size(0),
              "multimnist_loss: labels must be [B, 2] with B = ", lengths.size(0), ", got ", labels.sizes());
  const int64_t K = lengths.size(1);
  // T_k = 1 for both present classes. Equal labels would give T = 2 and a wrong loss: refuse them.
  auto targets = torch::one_hot(labels.select(1, 0), K) + torch::one_hot(labels.select(1, 1), K);  // [B, K]
  TORCH_CHECK(targets.max().item<int64_t>() <= 1, "multimnist_loss: the two labels of an example must differ");
  MultiMnistLoss l;
  l.margin = margin_loss_multi(lengths, targets);
  if (f.reconstructions.defined()) {
    TORCH_CHECK(digits.dim() >= 3 && digits.size(0) == lengths.size(0) && digits.size(1) == 2,
                "multimnist_loss: digits must be [B, 2, C, S, S], got ", digits.sizes());
    l.reconstruction =
        reconstruction_loss(f.reconstructions.select(1, 0), digits.select(1, 0), config.reconstruction_scale) +
        reconstruction_loss(f.reconstructions.select(1, 1), digits.select(1, 1), config.reconstruction_scale);
  } else {
    l.reconstruction = torch::zeros({}, l.margin.options());
  }
  l.total = l.margin + l.reconstruction;
  return l;
}

torch::Tensor multimnist_cnn_loss(const torch::Tensor& logits, const torch::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 2, "multimnist_cnn_loss: logits must be [B, K], got ",
              logits.sizes());
  TORCH_CHECK(labels.dim() == 2 && labels.size(1) == 2 && labels.size(0) == logits.size(0),
              "multimnist_cnn_loss: labels must be [B, 2] with B = ", logits.size(0), ", got ", labels.sizes());
  const int64_t K = logits.size(1);
  auto targets = torch::one_hot(labels.select(1, 0), K) + torch::one_hot(labels.select(1, 1), K);  // [B, K]
  TORCH_CHECK(targets.max().item<int64_t>() <= 1, "multimnist_cnn_loss: the two labels of an example must differ");
  namespace F = torch::nn::functional;
  // Sum over classes (each class is its own yes/no question), mean over the batch.
  return F::binary_cross_entropy_with_logits(logits, targets.to(logits.dtype()),
                                             F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(torch::kSum)) /
         static_cast<double>(logits.size(0));
}

torch::Tensor two_longest(const torch::Tensor& lengths) {
  TORCH_CHECK(lengths.dim() == 2 && lengths.size(1) >= 2, "two_longest: lengths must be [B, K] with K >= 2, got ",
              lengths.sizes());
  return std::get<1>(lengths.topk(2, /*dim=*/1, /*largest=*/true, /*sorted=*/true));  // [B, 2]
}

torch::Tensor both_found(const torch::Tensor& lengths, const torch::Tensor& labels) {
  TORCH_CHECK(labels.dim() == 2 && labels.size(1) == 2 && labels.size(0) == lengths.size(0),
              "both_found: labels must be [B, 2] with B = ", lengths.size(0), ", got ", labels.sizes());
  auto p = two_longest(lengths);
  auto l = labels.to(torch::kLong);
  auto p0 = p.select(1, 0), p1 = p.select(1, 1), l0 = l.select(1, 0), l1 = l.select(1, 1);
  return (p0.eq(l0) & p1.eq(l1)) | (p0.eq(l1) & p1.eq(l0));  // [B]
}

MultiMnistEval evaluate_multimnist(models::CapsNet& model, const data::MultiMnist& pairs, int64_t count,
                                   int64_t batch_size, std::ostream* progress) {
  check_pairs_fit(model->config, pairs, "test");
  return evaluate_pairs(*model, pairs, count, batch_size, progress, [&](const data::MultiMnistBatch& batch) {
    auto f = forward_pair(model, batch.images, batch.labels);
    const double loss = multimnist_loss(model->config, f, batch.labels, batch.digits).total.item<double>();
    return std::make_pair(f.out.lengths, loss);
  });
}

MultiMnistEval evaluate_multimnist(models::BaselineCnn& model, const data::MultiMnist& pairs, int64_t count,
                                   int64_t batch_size, std::ostream* progress) {
  check_pairs_fit(model->config, pairs, "test");
  return evaluate_pairs(*model, pairs, count, batch_size, progress, [&](const data::MultiMnistBatch& batch) {
    auto logits = model(batch.images);  // [B, K]
    return std::make_pair(logits, multimnist_cnn_loss(logits, batch.labels).item<double>());
  });
}

namespace {

/// MultiMNIST as a train::Task: a stream of generated pairs (step s uses pairs [s B, (s + 1) B)); the
/// metric is "both digits found". The two models differ in their model, loss and scores only.
class MultiMnistTaskBase : public train::Task {
 public:
  MultiMnistTaskBase(const MultiMnistTrainOptions& o, const data::MultiMnist& train_pairs,
                     const data::MultiMnist* test_pairs)
      : o_(o), train_(train_pairs), test_(test_pairs) {}

  nlohmann::json data_config() const override {
    nlohmann::json generator = {{"seed", train_.seed()},
                                {"source_size", train_.source_size()},
                                {"pad", train_.options().pad},
                                {"max_shift", train_.options().max_shift}};
    // Checkpoints from before the overlay option have no "overlay" and were trained with max. The
    // loop compares this object as a whole on resume, so max is recorded by leaving the key out: an
    // old checkpoint then resumes with --overlay max and is refused with add (and the reverse).
    if (train_.options().overlay != data::Overlay::kMax)
      generator["overlay"] = data::overlay_name(train_.options().overlay);
    return {{"train_generator", generator}};
  }
  int64_t epoch_size() const override { return static_cast<int64_t>(kDecayImages); }
  bool shuffle() const override { return false; }

  train::Batch batch(const torch::Tensor& ids, at::Generator&) const override {
    // ids are consecutive (a stream): the generator makes pairs start .. start + B - 1.
    auto b = train_.generate(ids[0].item<int64_t>(), ids.size(0));
    return {{b.images, b.labels, b.digits}};  // [B, 1, S, S], [B, 2], [B, 2, 1, S, S]
  }
  std::optional<train::Evaluation> evaluate(std::ostream* progress) override {
    if (!test_ || o_.test_size == 0) return std::nullopt;
    auto r = evaluate_test(progress);
    train::Evaluation e{{{"accuracy", r.accuracy},
                  {"error", 1 - r.accuracy},
                  {"digit_accuracy", r.digit_accuracy},
                  {"loss", r.loss},
                  {"examples", r.examples},
                  {"overlap_iou", r.overlap.mean_iou()},
                  {"overlap_over_smaller", r.overlap.mean_over_smaller()},
                  {"seconds", r.seconds}},
                 fmt::format("test both found {:.2f}% (error {:.2f}%, {} pairs)", 100 * r.accuracy,
                             100 * (1 - r.accuracy), r.examples)};
    last_ = std::move(r);
    return e;
  }

  std::optional<MultiMnistEval> last_;

 protected:
  virtual MultiMnistEval evaluate_test(std::ostream* progress) = 0;

  const MultiMnistTrainOptions& o_;
  const data::MultiMnist& train_;
  const data::MultiMnist* test_;
};

/// The paper's CapsNet: both digits' margin loss and reconstructions.
class MultiMnistTask : public MultiMnistTaskBase {
 public:
  using MultiMnistTaskBase::MultiMnistTaskBase;

  std::string name() const override { return "multimnist"; }
  std::shared_ptr<torch::nn::Module> build_model(Precision precision) override {
    model_ = models::CapsNet(o_.model);
    model_->set_fused_routing(o_.fused_routing);
    model_->set_precision(precision);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return o_.model.to_json(); }
  bool config_matches(const nlohmann::json& saved) const override { return models::same_config(saved, o_.model); }
  std::string describe() const override {
    return fmt::format("MultiMNIST CapsNet ({} primary capsules, {}x{} input)", o_.model.num_primary_caps(),
                       o_.model.image_size, o_.model.image_size);
  }
  train::TaskLoss loss(const train::Batch& rows) override {
    const auto& images = rows[0];
    const auto& labels = rows[1];
    auto f = forward_pair(model_, images, labels);
    auto l = multimnist_loss(o_.model, f, labels, rows[2]);
    auto found = both_found(f.out.lengths.detach(), labels).to(torch::kFloat64).mean();
    return {l.total, {{"margin_loss", l.margin}, {"reconstruction_loss", l.reconstruction}, {"accuracy", found}}};
  }

 private:
  MultiMnistEval evaluate_test(std::ostream* progress) override {
    return evaluate_multimnist(model_, *test_, o_.test_size, o_.eval_batch_size, progress);
  }
  models::CapsNet model_{nullptr};
};

/// The baseline CNN: a sigmoid per class, its two largest logits are its answer.
class MultiMnistCnnTask : public MultiMnistTaskBase {
 public:
  using MultiMnistTaskBase::MultiMnistTaskBase;

  std::string name() const override { return "multimnist-cnn"; }
  std::shared_ptr<torch::nn::Module> build_model(Precision precision) override {
    model_ = models::BaselineCnn(o_.cnn);
    model_->set_precision(precision);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return o_.cnn.to_json(); }
  std::string describe() const override {
    return fmt::format("MultiMNIST baseline CNN ({}x{} input, multi-label sigmoid outputs)", o_.cnn.image_size,
                       o_.cnn.image_size);
  }
  train::TaskLoss loss(const train::Batch& rows) override {
    const auto& labels = rows[1];
    auto logits = model_(rows[0]);  // [B, K]; dropout active (training)
    auto found = both_found(logits.detach(), labels).to(torch::kFloat64).mean();
    return {multimnist_cnn_loss(logits, labels), {{"accuracy", found}}};
  }

 private:
  MultiMnistEval evaluate_test(std::ostream* progress) override {
    return evaluate_multimnist(model_, *test_, o_.test_size, o_.eval_batch_size, progress);
  }
  models::BaselineCnn model_{nullptr};
};

}  // namespace

MultiMnistTrainResult train_multimnist(const MultiMnistTrainOptions& options, const data::MultiMnist& train_pairs,
                                       const data::MultiMnist* test_pairs, std::ostream& log,
                                       std::shared_ptr<train::ProcessGroup> group) {
  options.validate();
  const bool cnn = options.which == MultiMnistModel::kCnn;
  for (const auto* pairs : {&train_pairs, test_pairs && options.test_size > 0 ? test_pairs : nullptr}) {
    if (!pairs) continue;
    const char* what = pairs == &train_pairs ? "training" : "test";
    cnn ? check_pairs_fit(options.cnn, *pairs, what) : check_pairs_fit(options.model, *pairs, what);
  }
  std::unique_ptr<MultiMnistTaskBase> task;
  if (cnn)
    task = std::make_unique<MultiMnistCnnTask>(options, train_pairs, test_pairs);
  else
    task = std::make_unique<MultiMnistTask>(options, train_pairs, test_pairs);
  auto r = train::run(*task, options.loop, log, std::move(group));
  MultiMnistTrainResult result{train::RunStats::of(r), std::move(task->last_)};
  if (!result.losses.empty()) {
    auto mean = [](const std::vector<double>& v) {
      double s = 0;
      for (double x : v) s += x;
      return v.empty() ? 0.0 : s / static_cast<double>(v.size());
    };
    log << fmt::format("trained steps {}..{} ({} pairs) in {:.1f} s ({:.1f} img/s), mean train loss {:.4f}, both "
                       "found {:.2f}% (on the fly, while training)\n",
                       r.start_step, r.end_step, result.images_seen, result.seconds, result.images_per_second,
                       mean(result.losses), 100.0 * mean(r.accuracies));
  }
  return result;
}

std::array<int64_t, 2> align_to_labels(std::array<int64_t, 2> p, std::array<int64_t, 2> l) {
  if (p[1] == l[0] || p[0] == l[1]) std::swap(p[0], p[1]);
  return p;
}

torch::Tensor multimnist_panel(const torch::Tensor& image, const torch::Tensor& reconstructions,
                               std::array<int64_t, 2> from, std::array<int64_t, 2> labels, int64_t zoom) {
  TORCH_CHECK(image.dim() == 2 && image.size(0) == image.size(1), "multimnist_panel: image must be [S, S], got ",
              image.sizes());
  TORCH_CHECK(reconstructions.dim() == 3 && reconstructions.size(0) == 2 &&
                  reconstructions.size(1) == image.size(0) && reconstructions.size(2) == image.size(1),
              "multimnist_panel: reconstructions must be [2, ", image.size(0), ", ", image.size(1), "], got ",
              reconstructions.sizes());
  TORCH_CHECK(zoom >= 1, "multimnist_panel: zoom must be >= 1, got ", zoom);
  auto up = [zoom](const torch::Tensor& t) {
    return t.to(torch::kFloat).repeat_interleave(zoom, 0).repeat_interleave(zoom, 1);
  };
  constexpr int64_t gap = 2;
  const int64_t side = image.size(0) * zoom, width = 3 * side + 2 * gap;
  const auto text = fmt::format("R:({},{}) L:({},{})", from[0], from[1], labels[0], labels[1]);
  const int64_t scale = viz::text_width(text, 2) <= width ? 2 : 1, caption = 5 * scale + 4;
  const bool right = (from[0] == labels[0] && from[1] == labels[1]) || (from[0] == labels[1] && from[1] == labels[0]);
  auto panel = torch::zeros({caption + side, width});
  viz::draw_text(panel, std::max<int64_t>(0, (width - viz::text_width(text, scale)) / 2), 2, text, scale,
                 right ? 1.0f : 0.6f);  // misclassified: dimmer caption
  panel.narrow(0, caption, side).narrow(1, 0, side).copy_(up(image));
  for (int64_t k = 0; k < 2; ++k)
    panel.narrow(0, caption, side).narrow(1, (k + 1) * (side + gap), side).copy_(up(reconstructions[k]));
  return panel;
}

torch::Tensor multimnist_figure(models::CapsNet& model, const data::MultiMnist& pairs, int64_t correct,
                                int64_t wrong, int64_t columns, int64_t scan_limit) {
  if (correct < 0 || wrong < 0 || correct + wrong == 0)
    throw std::invalid_argument(fmt::format("multimnist_figure: nothing to show (correct {}, wrong {})", correct, wrong));
  if (columns < 1 || scan_limit < 1)
    throw std::invalid_argument(
        fmt::format("multimnist_figure: columns and scan limit must be >= 1, got {} and {}", columns, scan_limit));
  if (!model->config.reconstruction)
    throw std::invalid_argument("multimnist_figure: the model has no decoder (trained without reconstruction)");
  check_pairs_fit(model->config, pairs, "figure");
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  const int64_t S = pairs.canvas_size();
  std::vector<torch::Tensor> right_panels, wrong_panels;
  for (int64_t start = 0; start < scan_limit && (static_cast<int64_t>(right_panels.size()) < correct ||
                                                 static_cast<int64_t>(wrong_panels.size()) < wrong);
       start += 100) {
    const int64_t len = std::min<int64_t>(100, scan_limit - start);
    auto batch = pairs.generate(start, len);
    auto out = model->forward(batch.images);
    auto top = two_longest(out.lengths);  // [B, 2]
    auto ok = both_found(out.lengths, batch.labels);
    for (int64_t b = 0; b < len; ++b) {
      const bool is_right = ok[b].item<bool>();
      auto& panels = is_right ? right_panels : wrong_panels;
      if (static_cast<int64_t>(panels.size()) >= (is_right ? correct : wrong)) continue;
      const std::array<int64_t, 2> labels{batch.labels[b][0].item<int64_t>(), batch.labels[b][1].item<int64_t>()};
      const auto from = align_to_labels({top[b][0].item<int64_t>(), top[b][1].item<int64_t>()}, labels);
      auto v = out.digit_caps.narrow(0, b, 1).expand({2, -1, -1});  // the same capsules, decoded twice
      auto recs = model->decode(v, torch::tensor({from[0], from[1]}, torch::kLong)).view({2, S, S});
      panels.push_back(multimnist_panel(batch.images[b][0], recs, from, labels));
    }
  }
  if (was_training) model->train();
  std::vector<torch::Tensor> panels = right_panels;
  panels.insert(panels.end(), wrong_panels.begin(), wrong_panels.end());
  if (panels.empty()) throw std::invalid_argument("multimnist_figure: no example found to show");
  return viz::tile(panels, columns, 4, 0.25f);
}

}  // namespace capsnet::experiments
