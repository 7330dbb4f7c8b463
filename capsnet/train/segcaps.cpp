#include "capsnet/train/segcaps.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <stdexcept>

#include "capsnet/train/metrics.h"
#include "capsnet/viz/figures.h"

namespace capsnet::train {

void SegCapsTrainOptions::validate() const {
  model.validate();
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw std::invalid_argument(fmt::format("segcaps: {} must be positive, got {}", name, v));
  };
  positive("steps", steps);
  positive("batch_size", batch_size);
  positive("test_size", test_size);
  positive("eval_batch_size", eval_batch_size);
  positive("log_every", log_every);
  if (!(lr > 0)) throw std::invalid_argument(fmt::format("segcaps: lr must be positive, got {}", lr));
  if (!(max_seconds >= 0)) throw std::invalid_argument(fmt::format("segcaps: max_seconds must be >= 0, got {}", max_seconds));
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
    auto out = model->forward(batch.images);
    loss_sum += model->loss(out, batch.masks).item<double>() * static_cast<double>(len);
    dice_sum += data::dice_per_image(out.probability > threshold, batch.masks).sum().item<double>();
  }
  model->train(was_training);
  r.examples = count;
  r.mean_dice = dice_sum / static_cast<double>(count);
  r.loss = loss_sum / static_cast<double>(count);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
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
  for (int k = 1; k <= 19; ++k) {
    const double t = 0.05 * k;
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

SegCapsTrainResult train_segcaps(const SegCapsTrainOptions& options, const data::DigitSegmentation& train_set,
                                 const data::DigitSegmentation& test_set, std::ostream& log) {
  options.validate();
  if (train_set.canvas_size() != options.model.image_size || test_set.canvas_size() != options.model.image_size)
    throw std::invalid_argument(fmt::format("segcaps: the data canvas ({}) must equal the model image_size ({})",
                                            train_set.canvas_size(), options.model.image_size));
  std::filesystem::create_directories(options.out_dir);
  torch::manual_seed(options.seed);
  SegCapsTrainResult result;
  result.model = models::SegCaps(options.model);
  auto& model = result.model;
  model->set_fused_routing(options.fused_routing);
  model->train();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(options.lr));
  JsonLinesWriter metrics(options.out_dir + "/metrics.jsonl", /*truncate=*/true);
  log << fmt::format("segcaps: {} steps of {} generated {}x{} images, {} parameters\n", options.steps,
                     options.batch_size, options.model.image_size, options.model.image_size,
                     [&] {
                       int64_t n = 0;
                       for (const auto& p : model->parameters()) n += p.numel();
                       return n;
                     }());

  const auto t0 = std::chrono::steady_clock::now();
  ProgressBar bar(std::cerr, "segcaps", options.steps, options.progress);
  double window_loss = 0, window_dice = 0;
  int64_t window = 0, steps_run = 0;
  for (int64_t step = 0; step < options.steps; ++step) {
    auto batch = train_set.generate(step * options.batch_size, options.batch_size);
    auto out = model->forward(batch.images);
    auto loss = model->loss(out, batch.masks);
    if (!std::isfinite(loss.item<double>()))
      throw std::runtime_error(fmt::format("segcaps: loss is not finite at step {}", step + 1));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    window_loss += loss.item<double>();
    {
      torch::NoGradGuard no_grad;
      window_dice += data::dice_per_image(out.probability > options.threshold, batch.masks).mean().item<double>();
    }
    ++window;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double ips = static_cast<double>((step + 1) * options.batch_size) / std::max(elapsed, 1e-9);
    steps_run = step + 1;
    const bool out_of_time = options.max_seconds > 0 && elapsed > options.max_seconds;
    if ((step + 1) % options.log_every == 0 || step + 1 == options.steps || out_of_time) {
      const double mean_loss = window_loss / static_cast<double>(window);
      const double mean_dice = window_dice / static_cast<double>(window);
      result.losses.push_back(mean_loss);
      metrics.write({{"step", step + 1},
                     {"images", (step + 1) * options.batch_size},
                     {"train_loss", mean_loss},
                     {"train_dice", mean_dice},
                     {"seconds", elapsed},
                     {"images_per_second", ips}});
      if (!options.progress)
        log << fmt::format("step {}/{}: loss {:.4f} train Dice {:.3f} ({:.1f} img/s)\n", step + 1, options.steps,
                           mean_loss, mean_dice, ips)
            << std::flush;  // a log file shows progress while the run goes on
      window_loss = window_dice = 0;
      window = 0;
    }
    bar.update(step + 1, fmt::format("loss {:.4f} {:.1f} img/s", loss.item<double>(), ips));
    if (out_of_time) {
      log << fmt::format("segcaps: stopping after {} of {} steps: the --max-minutes budget ({:.0f} s) is spent\n",
                         steps_run, options.steps, options.max_seconds);
      break;
    }
  }
  result.steps = steps_run;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  result.images_per_second = static_cast<double>(steps_run * options.batch_size) / std::max(result.seconds, 1e-9);
  bar.finish(fmt::format("{:.1f} s, {:.1f} img/s", result.seconds, result.images_per_second));

  torch::save(model, options.out_dir + "/model.pt");
  result.test = evaluate_segcaps(model, test_set, 0, options.test_size, options.eval_batch_size, options.threshold);
  metrics.write({{"step", steps_run},
                 {"split", "test"},
                 {"test_examples", result.test.examples},
                 {"test_dice", result.test.mean_dice},
                 {"test_loss", result.test.loss}});
  return result;
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

}  // namespace capsnet::train
