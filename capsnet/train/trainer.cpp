#include "capsnet/train/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <iostream>

#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/distributed.h"
#include "capsnet/train/metrics.h"

namespace capsnet::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// Independent generator streams derived from (seed, purpose, index): the data order of an epoch
/// and the shifts of a step are functions of the step alone, which is what makes resume exact.
at::Generator stream(uint64_t seed, uint64_t purpose, uint64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (purpose << 56) ^ index;
  x ^= x >> 33;  // splitmix64 finaliser
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return at::make_generator<at::CPUGeneratorImpl>(x);
}

bool all_finite(const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  for (const auto& t : tensors)
    if (!torch::isfinite(t).all().item<bool>()) return false;
  return true;
}

void check_resume_compatible(const nlohmann::json& saved, const nlohmann::json& now, const std::string& path) {
  // Options that change the sequence of batches or updates must match for an exact resume.
  for (const char* key : {"batch_size", "lr", "lr_decay", "max_shift", "seed", "train_examples"}) {
    if (saved.contains(key) && now.contains(key) && saved[key] != now[key])
      throw std::invalid_argument(fmt::format("--resume {}: option {} is {} in the checkpoint but {} now; "
                                              "an exact resume needs the same value",
                                              path, key, saved[key].dump(), now[key].dump()));
  }
}

}  // namespace

void TrainOptions::validate() const {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  model.validate();
  if (batch_size <= 0) fail(fmt::format("batch size must be positive, got {}", batch_size));
  if (eval_batch_size <= 0) fail(fmt::format("eval batch size must be positive, got {}", eval_batch_size));
  if (!(lr > 0) || !std::isfinite(lr)) fail(fmt::format("learning rate must be a positive number, got {}", lr));
  if (!(lr_decay > 0 && lr_decay <= 1)) fail(fmt::format("lr decay must be in (0, 1], got {}", lr_decay));
  if (epochs < 0) fail(fmt::format("epochs must be >= 0, got {}", epochs));
  if (max_steps < 0) fail(fmt::format("max steps must be >= 0, got {}", max_steps));
  if (epochs == 0 && max_steps == 0) fail("nothing to do: epochs and max steps are both 0");
  if (max_shift < 0 || max_shift >= model.image_size)
    fail(fmt::format("max shift must be in [0, {}), got {}", model.image_size, max_shift));
  if (checkpoint_every < 0) fail(fmt::format("checkpoint interval must be >= 0, got {}", checkpoint_every));
  if (log_every <= 0) fail(fmt::format("log interval must be positive, got {}", log_every));
  if (out_dir.empty()) fail("output directory must not be empty");
  nn::parse_precision(precision);  // throws naming the value (or a CPU without bf16)
}

nlohmann::json TrainOptions::to_json() const {
  return {{"epochs", epochs},
          {"max_steps", max_steps},
          {"batch_size", batch_size},
          {"lr", lr},
          {"lr_decay", lr_decay},
          {"max_shift", max_shift},
          {"seed", seed},
          {"checkpoint_every", checkpoint_every},
          {"precision", nn::precision_name(nn::parse_precision(precision))},
          {"out_dir", out_dir}};
}

std::string checkpoint_path(const std::string& out_dir) { return out_dir + "/checkpoint.pt"; }
std::string metrics_path(const std::string& out_dir) { return out_dir + "/metrics.jsonl"; }

TrainResult train(const TrainOptions& options, const data::ImageSet& train_set, const data::ImageSet* test_set,
                  std::ostream& all_log, std::shared_ptr<ProcessGroup> group) {
  options.validate();
  const int64_t n = train_set.size();
  if (n == 0) throw std::invalid_argument("training set is empty");
  const int rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  if (world > 1 && (options.batch_size < world || (n % options.batch_size != 0 && n % options.batch_size < world)))
    throw std::invalid_argument(fmt::format("{} processes need at least {} examples in every batch, but batch size "
                                            "{} over {} examples leaves a last batch of {}",
                                            world, world, options.batch_size, n,
                                            n % options.batch_size == 0 ? options.batch_size : n % options.batch_size));
  const bool lead = rank == 0;  // the one rank that logs, evaluates and writes files
  std::ostream null_log(nullptr);
  std::ostream& log = lead ? all_log : null_log;
  const bool progress = options.progress && lead;
  if (train_set.images.size(1) != options.model.image_size || train_set.images.size(2) != options.model.image_size)
    throw std::invalid_argument(fmt::format("training images are {}x{} but the model expects {}x{}",
                                            train_set.images.size(1), train_set.images.size(2),
                                            options.model.image_size, options.model.image_size));
  auto options_json = options.to_json();
  options_json["train_examples"] = n;

  torch::manual_seed(options.seed);
  models::CapsNet model(options.model);
  model->set_fused_routing(options.fused_routing);
  model->set_precision(nn::parse_precision(options.precision));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(options.lr));
  const std::string ckpt = checkpoint_path(options.out_dir);

  int64_t step = 0;
  if (!options.resume.empty()) {
    auto meta = read_checkpoint_meta(options.resume);
    check_resume_compatible(meta.train_options, options_json, options.resume);
    step = load_checkpoint(options.resume, model, &optimizer).step;
    log << fmt::format("resumed from {} at step {}\n", options.resume, step);
  }
  model->train();
  std::optional<GradientReducer> reducer;
  if (group) {
    // The same seed already gives every rank the same weights; the broadcast also covers resumes
    // and anything else that could make rank 0's state the only one to trust.
    broadcast_parameters(*group, model->parameters());
    reducer.emplace(group, model->parameters());
  }

  const int64_t steps_per_epoch = (n + options.batch_size - 1) / options.batch_size;
  const int64_t total_steps = options.max_steps > 0 ? options.max_steps : options.epochs * steps_per_epoch;
  const int64_t total_epochs = (total_steps + steps_per_epoch - 1) / steps_per_epoch;
  JsonLinesWriter metrics = lead ? JsonLinesWriter(metrics_path(options.out_dir), /*truncate=*/options.resume.empty())
                                 : JsonLinesWriter();  // not open: writes nothing
  metrics.write({{"event", "start"},
                 {"step", step},
                 {"model", options.model.to_json()},
                 {"train", options_json},
                 {"parameters", models::count_parameters(*model)},
                 {"threads", at::get_num_threads()}});
  log << fmt::format(
      "CapsNet: {} parameters, {} training examples, batch {}, {} steps ({} per epoch), {} threads, {} compute\n",
      models::count_parameters(*model), n, options.batch_size, total_steps, steps_per_epoch, at::get_num_threads(),
      nn::precision_name(model->precision()));
  if (group)
    log << fmt::format("data parallel: {} processes, {} examples each per step, {} gradient buckets\n", world,
                       options.batch_size / world, reducer->bucket_count());

  TrainResult result;
  result.start_step = step;
  result.checkpoint = options.resume;
  int64_t last_saved = step;
  auto save = [&](int64_t at_step) {
    if (!all_finite(model->parameters()))
      throw TrainingDiverged(fmt::format("weights are not finite at step {}; not saving. The last good checkpoint "
                                         "is {} (step {}). Try a lower --lr.",
                                         at_step, result.checkpoint.empty() ? "(none)" : result.checkpoint,
                                         last_saved));
    if (lead) save_checkpoint(ckpt, model, &optimizer, {at_step, options.model.to_json(), options_json});
    result.checkpoint = ckpt;
    last_saved = at_step;
    metrics.write({{"event", "checkpoint"}, {"step", at_step}, {"path", ckpt}});
  };

  torch::Tensor perm;
  int64_t perm_epoch = -1;
  double run_seconds = 0;
  int64_t run_images = 0;
  // Running sums since the last "train" record and over the current epoch.
  double win_loss = 0, win_margin = 0, win_recon = 0, ep_loss = 0;
  int64_t win_correct = 0, win_seen = 0, win_steps = 0, ep_correct = 0, ep_seen = 0;
  std::optional<ProgressBar> bar;

  while (step < total_steps) {
    const int64_t epoch = step / steps_per_epoch, index = step % steps_per_epoch;
    if (epoch != perm_epoch) {
      auto gen = stream(options.seed, 1, static_cast<uint64_t>(epoch));
      perm = torch::randperm(n, gen, torch::kLong);
      perm_epoch = epoch;
      ep_loss = 0;
      ep_correct = ep_seen = 0;
      const int64_t epoch_steps = std::min(steps_per_epoch, total_steps - epoch * steps_per_epoch);
      bar.emplace(std::cerr, fmt::format("epoch {}/{}", epoch + 1, total_epochs), epoch_steps, progress);
    }
    if (group) maybe_inject_fault(rank, step);
    const auto t0 = Clock::now();
    const int64_t begin = index * options.batch_size, len = std::min(options.batch_size, n - begin);
    auto ids = perm.narrow(0, begin, len);
    auto shift_gen = stream(options.seed, 2, static_cast<uint64_t>(step));
    auto images = data::random_shift(data::to_float(train_set.images.index_select(0, ids)), options.max_shift,
                                     shift_gen);  // [B, 1, 28, 28]
    auto labels = train_set.labels.index_select(0, ids);  // [B]
    if (group) {
      // Shifts are drawn for the whole global batch above, so each example gets the shift it would
      // get in one process; this rank keeps its rows.
      const auto [lo, hi] = rank_slice(len, rank, world);
      images = images.narrow(0, lo, hi - lo);  // [b, 1, 28, 28]
      labels = labels.narrow(0, lo, hi - lo);  // [b]
    }

    const double lr = options.lr * std::pow(options.lr_decay, static_cast<double>(step) / steps_per_epoch);
    for (auto& group : optimizer.param_groups()) static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);

    auto out = model(images, labels);
    auto loss = model->loss(out, images, labels);
    double loss_value = loss.total.item<double>();
    double margin_value = 0, recon_value = 0;
    int64_t correct = 0;
    if (group) {
      // Global means over the batch, so logs, metrics and the divergence check match one process.
      const double local = static_cast<double>(images.size(0));
      auto stats = torch::tensor({loss_value * local, loss.margin.item<double>() * local,
                                  loss.reconstruction.item<double>() * local,
                                  out.lengths.argmax(1).eq(labels).sum().item<double>()},
                                 torch::kFloat64);
      std::vector<torch::Tensor> one{stats};
      group->allreduce_sum(one);
      loss_value = stats[0].item<double>() / len;
      margin_value = stats[1].item<double>() / len;
      recon_value = stats[2].item<double>() / len;
      correct = static_cast<int64_t>(stats[3].item<double>() + 0.5);
    }
    if (!std::isfinite(loss_value))
      throw TrainingDiverged(fmt::format("loss is {} at step {} (epoch {}); stopping. The last good checkpoint is "
                                         "{} (step {}). Try a lower --lr.",
                                         loss_value, step, epoch + 1,
                                         result.checkpoint.empty() ? "(none written yet)" : result.checkpoint,
                                         last_saved));
    optimizer.zero_grad();
    if (group) {
      // The loss is a mean over this rank's b rows; weighting it by b * W / B before the average
      // over W ranks gives sum_r (b_r / B) grad_r, the gradient of the mean over the global batch.
      (loss.total * (static_cast<double>(images.size(0)) * world / len)).backward();
      reducer->average();
    } else {
      loss.total.backward();
    }
    optimizer.step();
    ++step;

    if (!group) {
      correct = out.lengths.argmax(1).eq(labels).sum().item<int64_t>();
      margin_value = loss.margin.item<double>();
      recon_value = loss.reconstruction.item<double>();
    }
    run_seconds += seconds_since(t0);
    run_images += len;
    result.losses.push_back(loss_value);
    win_loss += loss_value;
    win_margin += margin_value;
    win_recon += recon_value;
    win_correct += correct;
    win_seen += len;
    ++win_steps;
    ep_loss += loss_value * len;
    ep_correct += correct;
    ep_seen += len;
    const double img_s = run_seconds > 0 ? run_images / run_seconds : 0;
    bar->update(step - epoch * steps_per_epoch,
                fmt::format("loss {:.4f} acc {:.2f}% {:.0f} img/s", ep_loss / ep_seen, 100.0 * ep_correct / ep_seen,
                            img_s));

    if (step % options.log_every == 0 || step == total_steps) {
      metrics.write({{"event", "train"},
                     {"step", step},
                     {"epoch", static_cast<double>(step) / steps_per_epoch},
                     {"loss", win_loss / win_steps},
                     {"margin_loss", win_margin / win_steps},
                     {"reconstruction_loss", win_recon / win_steps},
                     {"accuracy", static_cast<double>(win_correct) / win_seen},
                     {"lr", lr},
                     {"images_per_second", img_s}});
      win_loss = win_margin = win_recon = 0;
      win_correct = win_seen = win_steps = 0;
    }
    const bool epoch_end = step % steps_per_epoch == 0 || step == total_steps;
    if ((options.checkpoint_every > 0 && step % options.checkpoint_every == 0) || epoch_end) save(step);
    if (epoch_end) {
      bar->finish(fmt::format("loss {:.4f} acc {:.2f}% {:.0f} img/s", ep_loss / ep_seen,
                              100.0 * ep_correct / ep_seen, img_s));
      std::string line = fmt::format("epoch {}: train loss {:.4f} accuracy {:.2f}% ({:.0f} img/s)", epoch + 1,
                                     ep_loss / ep_seen, 100.0 * ep_correct / ep_seen, img_s);
      if (test_set && options.evaluate_each_epoch && lead) {
        auto r = evaluate(model, *test_set, options.eval_batch_size, progress ? &std::cerr : nullptr);
        metrics.write({{"event", "eval"},
                       {"split", "test"},
                       {"step", step},
                       {"epoch", static_cast<double>(step) / steps_per_epoch},
                       {"accuracy", r.accuracy},
                       {"error", 1 - r.accuracy},
                       {"loss", r.loss},
                       {"examples", r.examples},
                       {"train_seconds", run_seconds}});
        line += fmt::format(" | test loss {:.4f} accuracy {:.2f}% ({} images)", r.loss, 100 * r.accuracy,
                            r.examples);
        result.test = std::move(r);
      }
      log << line << '\n' << std::flush;
    }
  }
  result.end_step = step;
  result.seconds = run_seconds;
  result.images_per_second = run_seconds > 0 ? run_images / run_seconds : 0;
  metrics.write({{"event", "end"}, {"step", step}, {"seconds", run_seconds}, {"images_per_second",
                                                                              result.images_per_second}});
  return result;
}

}  // namespace capsnet::train
