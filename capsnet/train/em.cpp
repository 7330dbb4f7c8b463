#include "capsnet/train/em.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>
#include <stdexcept>

#include "capsnet/models/capsnet.h"
#include "capsnet/nn/em_routing.h"
#include "capsnet/train/metrics.h"
#include "capsnet/train/trainer.h"

namespace capsnet::train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

void EmTrainOptions::validate() const {
  model.validate();
  auto positive = [](int64_t v, const char* name) {
    if (v < 1) throw std::invalid_argument(fmt::format("em: {} must be >= 1, got {}", name, v));
  };
  positive(steps, "steps");
  positive(batch_size, "batch_size");
  positive(eval_batch_size, "eval_batch_size");
  positive(log_every, "log_every");
  if (!(lr > 0)) throw std::invalid_argument(fmt::format("em: lr must be > 0, got {}", lr));
  if (!(weight_decay >= 0)) throw std::invalid_argument(fmt::format("em: weight_decay must be >= 0, got {}", weight_decay));
  if (!(margin_start >= 0) || !(margin_end >= 0))
    throw std::invalid_argument(fmt::format("em: margins must be >= 0, got {} and {}", margin_start, margin_end));
  if (train_size < 0) throw std::invalid_argument(fmt::format("em: train_size must be >= 0, got {}", train_size));
  if (test_size < 0) throw std::invalid_argument(fmt::format("em: test_size must be >= 0, got {}", test_size));
  if (out_dir.empty()) throw std::invalid_argument("em: out_dir must not be empty");
}

nlohmann::json EmTrainOptions::to_json() const {
  return {{"out_dir", out_dir},           {"steps", steps},         {"batch_size", batch_size},
          {"lr", lr},                     {"weight_decay", weight_decay}, {"margin_start", margin_start},
          {"margin_end", margin_end},     {"seed", seed},           {"train_size", train_size},
          {"test_size", test_size},       {"eval_batch_size", eval_batch_size}, {"log_every", log_every}};
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
  ProgressBar bar(progress ? *progress : std::cerr, "eval", n, progress != nullptr);
  int64_t correct = 0;
  double loss_sum = 0;
  for (int64_t start = 0; start < n; start += batch_size) {
    const int64_t len = std::min(batch_size, n - start);
    auto images = to_input(set.images.narrow(0, start, len));
    auto labels = set.labels.narrow(0, start, len);
    auto out = model->forward(images);  // activations: [len, classes]
    correct += out.activations.argmax(1).eq(labels).sum().item<int64_t>();
    loss_sum += spread_loss(out.activations, labels, margin).item<double>() * len;
    bar.update(start + len, fmt::format("accuracy {:.2f}%", 100.0 * correct / (start + len)));
  }
  EmEval r;
  r.examples = n;
  r.accuracy = n ? double(correct) / n : 0;
  r.loss = n ? loss_sum / n : 0;
  r.seconds = seconds_since(t0);
  bar.finish(fmt::format("accuracy {:.2f}% (error {:.2f}%)", 100 * r.accuracy, 100 * (1 - r.accuracy)));
  if (was_training) model->train();
  return r;
}

EmTrainResult train_em(const EmTrainOptions& options, const data::ImageSet& train_full, const data::ImageSet* test_set,
                       std::ostream& log) {
  options.validate();
  const auto train_set = data::take(train_full, options.train_size);
  if (train_set.images.size(1) != options.model.image_size || train_set.images.size(2) != options.model.image_size)
    throw std::invalid_argument(fmt::format("em: the images are {}x{}, the model takes {}x{}",
                                            train_set.images.size(1), train_set.images.size(2),
                                            options.model.image_size, options.model.image_size));
  std::filesystem::create_directories(options.out_dir);
  torch::manual_seed(options.seed);
  models::MatrixCapsNet model(options.model);
  model->train();
  torch::optim::Adam optimizer(model->parameters(),
                               torch::optim::AdamOptions(options.lr).weight_decay(options.weight_decay));
  JsonLinesWriter metrics(options.out_dir + "/metrics.jsonl", /*truncate=*/true);
  const int64_t parameters = models::count_parameters(*model);
  metrics.write({{"event", "start"},
                 {"step", 0},
                 {"model", options.model.to_json()},
                 {"train", options.to_json()},
                 {"train_examples", train_set.size()},
                 {"parameters", parameters},
                 {"threads", at::get_num_threads()}});
  const auto sides = options.model.grid_sides();
  log << fmt::format(
      "matrix capsules (EM routing): {} parameters, A={} B={} C={} D={}, capsule grids {}x{} -> {}x{} -> {}x{}, {} "
      "routing iterations, batch {}, {} steps on {} training examples, {} threads\n",
      parameters, options.model.conv1_channels, options.model.primary_types, options.model.conv1_caps_types,
      options.model.conv2_caps_types, sides[0], sides[0], sides[1], sides[1], sides[2], sides[2],
      options.model.routing_iterations, options.batch_size, options.steps, train_set.size(), at::get_num_threads());

  // Example order: a seeded permutation per epoch (std::mt19937_64: the same on every LibTorch version).
  std::mt19937_64 rng(options.seed);
  std::vector<int64_t> order(static_cast<size_t>(train_set.size()));
  size_t cursor = order.size();
  auto next_batch = [&](int64_t B) {
    std::vector<int64_t> idx;
    idx.reserve(static_cast<size_t>(B));
    while (static_cast<int64_t>(idx.size()) < B) {
      if (cursor == order.size()) {
        std::iota(order.begin(), order.end(), int64_t{0});
        std::shuffle(order.begin(), order.end(), rng);
        cursor = 0;
      }
      idx.push_back(order[cursor++]);
    }
    return torch::tensor(idx, torch::kLong);
  };

  EmTrainResult result;
  ProgressBar bar(std::cerr, "em", options.steps, options.progress);
  double win_loss = 0, run_loss = 0;
  int64_t win_correct = 0, win_seen = 0, win_steps = 0, run_correct = 0;
  double margin = options.margin_start;
  for (int64_t step = 0; step < options.steps; ++step) {
    const auto t0 = Clock::now();
    margin = spread_margin(step, options.steps, options.margin_start, options.margin_end);
    auto idx = next_batch(options.batch_size);
    auto images = to_input(train_set.images.index_select(0, idx));  // [B, 1, S, S]
    auto labels = train_set.labels.index_select(0, idx);            // [B]
    auto out = model->forward(images);
    auto loss = spread_loss(out.activations, labels, margin);
    const double loss_value = loss.item<double>();
    if (!std::isfinite(loss_value))
      throw TrainingDiverged(fmt::format("em: loss is {} at step {}; stopping. Try a lower --lr.", loss_value, step));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();

    const int64_t correct = out.activations.detach().argmax(1).eq(labels).sum().item<int64_t>();
    const int64_t B = options.batch_size;
    result.seconds += seconds_since(t0);
    result.images_seen += B;
    result.steps = step + 1;
    result.losses.push_back(loss_value);
    win_loss += loss_value;
    win_correct += correct;
    win_seen += B;
    ++win_steps;
    run_loss += loss_value;
    run_correct += correct;
    const double img_s = result.images_seen / result.seconds;
    bar.update(step + 1, fmt::format("loss {:.4f} m {:.2f} acc {:.1f}% {:.0f} img/s", run_loss / (step + 1), margin,
                                     100.0 * run_correct / result.images_seen, img_s));
    if ((step + 1) % options.log_every == 0 || step + 1 == options.steps) {
      result.final_train_accuracy = double(win_correct) / win_seen;
      metrics.write({{"event", "train"},
                     {"step", step + 1},
                     {"images_seen", result.images_seen},
                     {"loss", win_loss / win_steps},
                     {"margin", margin},
                     {"accuracy", result.final_train_accuracy},
                     {"images_per_second", img_s}});
      win_loss = 0;
      win_correct = win_seen = win_steps = 0;
    }
  }
  result.images_per_second = result.seconds > 0 ? result.images_seen / result.seconds : 0;
  bar.finish(fmt::format("loss {:.4f} acc {:.1f}% {:.0f} img/s", run_loss / options.steps,
                         100.0 * run_correct / result.images_seen, result.images_per_second));
  log << fmt::format("trained {} steps ({} images) in {:.1f} s ({:.1f} img/s), mean spread loss {:.4f}, training "
                     "accuracy {:.2f}% (on the fly)\n",
                     result.steps, result.images_seen, result.seconds, result.images_per_second,
                     run_loss / options.steps, 100.0 * run_correct / result.images_seen);
  result.model_path = options.out_dir + "/model.pt";
  torch::save(model, result.model_path);

  if (test_set && options.test_size > 0) {
    result.test = evaluate_em(model, *test_set, options.test_size, options.eval_batch_size, options.margin_end,
                              options.progress ? &std::cerr : nullptr);
    metrics.write({{"event", "eval"},
                   {"split", "test"},
                   {"step", result.steps},
                   {"accuracy", result.test.accuracy},
                   {"error", 1 - result.test.accuracy},
                   {"loss", result.test.loss},
                   {"examples", result.test.examples},
                   {"seconds", result.test.seconds}});
  }
  metrics.write({{"event", "end"},
                 {"step", result.steps},
                 {"seconds", result.seconds},
                 {"images_per_second", result.images_per_second}});
  return result;
}

}  // namespace capsnet::train
