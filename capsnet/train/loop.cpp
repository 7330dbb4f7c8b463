#include "capsnet/train/loop.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>

#include "capsnet/models/capsnet.h"
#include "capsnet/train/adam_state.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/distributed.h"
#include "capsnet/train/fused_adam.h"
#include "capsnet/train/gradients.h"
#include "capsnet/train/metrics.h"

namespace capsnet::train {
namespace {

using Clock = std::chrono::steady_clock;

bool all_finite(const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  for (const auto& t : tensors)
    if (!torch::isfinite(t).all().item<bool>()) return false;
  return true;
}

// Options that change the sequence of batches or updates must match for an exact resume.
void check_resume_compatible(const nlohmann::json& saved, const nlohmann::json& now,
                             const std::vector<std::string>& keys, const std::string& path) {
  for (const auto& key : keys) {
    if (saved.contains(key) && now.contains(key) && saved[key] != now[key])
      throw std::invalid_argument(
          fmt::format("resume from {}: option {} is {} in the checkpoint but {} now; "
                      "an exact resume needs the same value",
                      path, key, saved[key].dump(), now[key].dump()));
  }
}

/// Where steps fall in epochs. Shuffled data: ceil(n / B) steps per epoch, the last batch short.
/// A stream: full batches, epoch e covering the steps whose first example lies in [e n, (e + 1) n).
struct Schedule {
  int64_t n, batch;
  bool shuffle;
  int64_t steps_per_epoch() const { return (n + batch - 1) / batch; }
  /// The epoch that step s (0-based, about to run) belongs to.
  int64_t epoch_of(int64_t s) const { return shuffle ? s / steps_per_epoch() : s * batch / n; }
  /// Epochs completed after `done` steps, as a fraction (the learning-rate decay's exponent).
  double epochs_done(int64_t done) const {
    return shuffle ? static_cast<double>(done) / steps_per_epoch() : static_cast<double>(done) * batch / n;
  }
  int64_t first_step(int64_t epoch) const {
    return shuffle ? epoch * steps_per_epoch() : (epoch * n + batch - 1) / batch;
  }
  int64_t total_steps(int64_t epochs) const {
    return shuffle ? epochs * steps_per_epoch() : (epochs * n + batch - 1) / batch;
  }
  /// Examples trained on after `done` steps.
  int64_t examples_done(int64_t done) const {
    return shuffle ? done / steps_per_epoch() * n + done % steps_per_epoch() * batch : done * batch;
  }
};

/// The best epoch-end validation of a run: highest accuracy, ties broken by the lower loss (the first
/// such epoch wins an exact tie). Travels in every checkpoint's options, so a resume keeps it.
struct BestValidation {
  std::optional<double> accuracy;
  double loss = 0;
  int64_t step = 0;

  static double number(const nlohmann::json& record, const char* key, double otherwise) {
    const auto it = record.find(key);
    return it != record.end() && it->is_number() ? it->get<double>() : otherwise;
  }
  /// Takes `e` when it beats the best so far; returns whether it did.
  bool offer(const Evaluation& e, int64_t at_step) {
    const double acc = number(e.record, "accuracy", -1), l = number(e.record, "loss", 0);
    if (acc < 0) return false;
    if (accuracy && (acc < *accuracy || (acc == *accuracy && l >= loss))) return false;
    accuracy = acc;
    loss = l;
    step = at_step;
    return true;
  }
  /// `options` with this record under "best_validation" (absent while there is none).
  nlohmann::json into(nlohmann::json options) const {
    if (accuracy) options["best_validation"] = {{"accuracy", *accuracy}, {"loss", loss}, {"step", step}};
    return options;
  }
  static BestValidation from_json(const nlohmann::json& options) {
    BestValidation b;
    if (!options.is_object() || !options.contains("best_validation")) return b;
    const auto& j = options["best_validation"];
    if (!j.is_object()) return b;
    b.accuracy = number(j, "accuracy", -1);
    if (*b.accuracy < 0) b.accuracy.reset();
    b.loss = number(j, "loss", 0);
    b.step = static_cast<int64_t>(number(j, "step", 0));
    return b;
  }
};

/// `from`'s bytes at `to`, replaced atomically (a reader of `to` sees the old file or the new one).
void copy_file_atomically(const std::string& from, const std::string& to) {
  const std::string tmp = to + ".tmp";
  std::filesystem::copy_file(from, tmp, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::rename(tmp, to);
}

/// Running means of the loss and the task's scalars, weighted by rows.
struct Window {
  double rows = 0, loss = 0;
  int64_t steps = 0;
  std::vector<std::pair<std::string, double>> sums;
  void add(double n_rows, double loss_value, const std::vector<std::pair<std::string, double>>& scalars) {
    if (sums.empty())
      for (const auto& [name, v] : scalars) sums.emplace_back(name, 0.0);
    rows += n_rows;
    loss += loss_value * n_rows;
    ++steps;
    for (size_t i = 0; i < scalars.size() && i < sums.size(); ++i) sums[i].second += scalars[i].second * n_rows;
  }
  double mean_loss() const { return rows > 0 ? loss / rows : 0; }
  std::optional<double> mean(const std::string& name) const {
    for (const auto& [key, v] : sums)
      if (key == name && rows > 0) return v / rows;
    return std::nullopt;
  }
  std::string summary(double images_per_second) const {
    std::string s = fmt::format("loss {:.4f}", mean_loss());
    if (auto acc = mean("accuracy")) s += fmt::format(" acc {:.2f}%", 100 * *acc);
    return s + fmt::format(" {:.0f} img/s", images_per_second);
  }
  void clear() { *this = Window{}; }
};

}  // namespace

Batch Batch::rows(int64_t begin, int64_t end) const {
  Batch out;
  out.fields.reserve(fields.size());
  for (const auto& f : fields) out.fields.push_back(f.narrow(0, begin, end - begin));
  return out;
}

at::Generator seeded_stream(uint64_t seed, uint64_t purpose, uint64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (purpose << 56) ^ index;
  x ^= x >> 33;  // splitmix64 finaliser
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return at::make_generator<at::CPUGeneratorImpl>(x);
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string checkpoint_path(const std::string& out_dir) { return out_dir + "/checkpoint.pt"; }
std::string metrics_path(const std::string& out_dir) { return out_dir + "/metrics.jsonl"; }
std::string best_checkpoint_path(const std::string& out_dir) { return out_dir + "/best.pt"; }

const char* lr_schedule_name(LrSchedule schedule) {
  return schedule == LrSchedule::kOneCycle ? "one-cycle" : "exponential";
}

LrSchedule parse_lr_schedule(const std::string& name) {
  if (name == "exponential") return LrSchedule::kExponential;
  if (name == "one-cycle") return LrSchedule::kOneCycle;
  throw std::invalid_argument(fmt::format("lr_schedule must be exponential or one-cycle, got '{}'", name));
}

double LoopOptions::learning_rate(int64_t step, int64_t total_steps, double epochs_done) const {
  if (lr_schedule == LrSchedule::kExponential)
    return lr * std::pow(lr_decay, lr_decay_steps > 0 ? static_cast<double>(step) / static_cast<double>(lr_decay_steps)
                                                      : epochs_done);
  // One cycle (Smith & Topin 2017): a short climb lets Adam settle before the large rate, the cosine
  // descent to ~0 ends the run in a sharp minimum whatever its length. Position in [0, 1]:
  const double t = total_steps > 1 ? static_cast<double>(step) / static_cast<double>(total_steps - 1) : 1.0;
  constexpr double kStartDiv = 25, kEndDiv = 1e4;  // lr / 25 at the start, lr / 1e4 at the end
  const double start = lr / kStartDiv, end = lr / kEndDiv;
  if (t < warmup_fraction) return start + (lr - start) * t / warmup_fraction;
  const double u = warmup_fraction < 1 ? (t - warmup_fraction) / (1 - warmup_fraction) : 1.0;
  return end + (lr - end) * 0.5 * (1 + std::cos(M_PI * u));
}

void LoopOptions::validate() const {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (batch_size <= 0) fail(fmt::format("batch_size must be positive, got {}", batch_size));
  if (!(lr > 0) || !std::isfinite(lr)) fail(fmt::format("lr must be a positive number, got {}", lr));
  if (!(lr_decay > 0 && lr_decay <= 1)) fail(fmt::format("lr_decay must be in (0, 1], got {}", lr_decay));
  if (lr_decay_steps < 0)
    fail(fmt::format("lr_decay_steps must be >= 0 (0 = decay once per epoch), got {}", lr_decay_steps));
  if (!(warmup_fraction >= 0 && warmup_fraction < 1))
    fail(fmt::format("warmup_fraction must be in [0, 1), got {}", warmup_fraction));
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay))
    fail(fmt::format("weight_decay must be >= 0, got {}", weight_decay));
  if (epochs < 0) fail(fmt::format("epochs must be >= 0, got {}", epochs));
  if (max_steps < 0) fail(fmt::format("max_steps must be >= 0, got {}", max_steps));
  if (epochs == 0 && max_steps == 0) fail("nothing to do: epochs and max_steps are both 0");
  if (checkpoint_every < 0) fail(fmt::format("checkpoint_every must be >= 0, got {}", checkpoint_every));
  if (log_every <= 0) fail(fmt::format("log_every must be positive, got {}", log_every));
  if (!(max_seconds >= 0)) fail(fmt::format("max_seconds must be >= 0, got {}", max_seconds));
  if (!(target_accuracy >= 0 && target_accuracy <= 1))
    fail(fmt::format("target_accuracy must be in [0, 1] (0 = none), got {}", target_accuracy));
  if (target_accuracy > 0 && !evaluate_each_epoch)
    fail("target_accuracy needs evaluate_each_epoch: the target is checked at every epoch's evaluation");
  if (eval_every < 0) fail(fmt::format("eval_every must be >= 0 (0 = only at epoch ends), got {}", eval_every));
  if (out_dir.empty()) fail("out_dir must not be empty");
}

nlohmann::json LoopOptions::to_json() const {
  nlohmann::json j = {{"epochs", epochs},
          {"max_steps", max_steps},
          {"batch_size", batch_size},
          {"lr", lr},
          {"lr_decay", lr_decay},
          {"lr_decay_steps", lr_decay_steps},
          {"lr_schedule", lr_schedule_name(lr_schedule)},
          {"weight_decay", weight_decay},
          {"seed", seed},
          {"checkpoint_every", checkpoint_every},
          {"precision", nn::precision_name(precision)},
          {"out_dir", out_dir}};
  if (target_accuracy > 0) j["target_accuracy"] = target_accuracy;
  if (eval_every > 0) j["eval_every"] = eval_every;
  return j;
}

LoopResult run(Task& task, const LoopOptions& options, std::ostream& all_log, std::shared_ptr<ProcessGroup> group) {
  options.validate();
  const Schedule schedule{task.epoch_size(), options.batch_size, task.shuffle()};
  if (schedule.n <= 0) throw std::invalid_argument(fmt::format("{}: the training set is empty", task.name()));
  const int rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;
  if (world > 1) {
    const int64_t last =
        schedule.shuffle && schedule.n % options.batch_size != 0 ? schedule.n % options.batch_size : options.batch_size;
    if (last < world)
      throw std::invalid_argument(
          fmt::format("{} processes need at least {} examples in every batch, but batch size "
                      "{} over {} examples leaves a last batch of {}",
                      world, world, options.batch_size, schedule.n, last));
  }
  const bool lead = rank == 0;  // the one rank that logs, evaluates and writes files
  std::ostream null_log(nullptr);
  std::ostream& log = lead ? all_log : null_log;
  const bool progress = options.progress && lead;

  auto options_json = options.to_json();
  options_json["task"] = task.name();
  const auto data_json = task.data_config();
  std::vector<std::string> resume_keys{"task",         "batch_size", "lr",  "lr_decay", "lr_decay_steps",
                                       "lr_schedule", "weight_decay", "seed"};
  const int64_t total_steps = options.max_steps > 0 ? options.max_steps : schedule.total_steps(options.epochs);
  if (options.lr_schedule == LrSchedule::kOneCycle) {
    // The cycle spans the whole run: resuming with another length would change every later rate.
    options_json["warmup_fraction"] = options.warmup_fraction;
    options_json["schedule_steps"] = total_steps;
    resume_keys.insert(resume_keys.end(), {"warmup_fraction", "schedule_steps"});
  }
  for (const auto& [key, value] : data_json.items()) {
    options_json[key] = value;
    resume_keys.push_back(key);
  }

  torch::manual_seed(options.seed);
  auto model = task.build_model(options.precision);
  if (group && task.steps_itself())
    throw std::invalid_argument(
        fmt::format("{}: this task makes its own optimizer updates and runs in one process only", task.name()));
  std::unique_ptr<torch::optim::Optimizer> optimizer = task.make_optimizer(*model, options);
  if (!optimizer)
    optimizer = make_adam(model->parameters(), torch::optim::AdamOptions(options.lr).weight_decay(options.weight_decay));
  const std::string ckpt = checkpoint_path(options.out_dir);

  int64_t step = 0;
  BestValidation best;
  if (!options.resume.empty()) {
    auto meta = read_checkpoint_meta(options.resume);
    auto saved_options = meta.train_options;
    if (saved_options.is_object() && !saved_options.contains("lr_schedule"))
      saved_options["lr_schedule"] = "exponential";  // checkpoints from before the option had only this one
    if (saved_options.is_object() && !saved_options.contains("lr_decay_steps"))
      saved_options["lr_decay_steps"] = 0;  // before the option, the rate decayed per epoch
    check_resume_compatible(saved_options, options_json, resume_keys, options.resume);
    step = load_checkpoint(options.resume, *model, optimizer.get(), [&](const nlohmann::json& saved) {
             return task.config_matches(saved);
           }).step;
    log << fmt::format("resumed from {} at step {}\n", options.resume, step);
    best = BestValidation::from_json(meta.train_options);
  }
  allocate_adam_state(*optimizer);  // before the first forward: lower peak memory (adam_state.h)
  clear_grads(*optimizer);          // every step starts without gradients (see the end of a step below)
  model->train();
  std::optional<GradientReducer> reducer;
  if (group) {
    // The same seed already gives every rank the same weights; the broadcast also covers resumes
    // and anything else that could make rank 0's state the only one to trust.
    broadcast_parameters(*group, model->parameters());
    reducer.emplace(group, model->parameters());
  }

  const int64_t total_epochs = schedule.epoch_of(total_steps - 1) + 1;
  JsonLinesWriter metrics = lead ? JsonLinesWriter(metrics_path(options.out_dir), /*truncate=*/options.resume.empty())
                                 : JsonLinesWriter();  // not open: writes nothing
  const int64_t parameters = models::count_parameters(*model);
  metrics.write({{"event", "start"},
                 {"task", task.name()},
                 {"step", step},
                 {"model", task.model_config()},
                 {"train", options_json},
                 {"parameters", parameters},
                 {"threads", at::get_num_threads()}});
  log << fmt::format(
      "{}: {} parameters, {} examples per epoch, batch {}, {} steps ({} per epoch), {} threads, {} "
      "compute\n",
      task.describe(), parameters, schedule.n, options.batch_size, total_steps, schedule.first_step(1),
      at::get_num_threads(), nn::precision_name(options.precision));
  if (group)
    log << fmt::format("data parallel: {} processes, {} examples each per step, {} gradient buckets\n", world,
                       options.batch_size / world, reducer->bucket_count());

  LoopResult result;
  result.start_step = step;
  result.total_steps = total_steps;
  result.checkpoint = options.resume;
  int64_t last_saved = step;
  // Not resuming, a checkpoint already in out_dir is a previous run's (the caller chose to replace
  // it): it stays until this run saves its own, and a divergence before that says so.
  std::error_code exists_error;
  const bool previous_checkpoint = options.resume.empty() && std::filesystem::exists(ckpt, exists_error);
  // A fresh run's first checkpoint replaces the previous run's; its best.pt goes with it.
  bool stale_best = options.resume.empty() && lead;
  auto last_good = [&] {
    if (!result.checkpoint.empty())
      return fmt::format("The last good checkpoint is {} (step {}). Try a lower learning rate (lr).",
                         result.checkpoint, last_saved);
    if (previous_checkpoint)
      return fmt::format("This run wrote no checkpoint yet; {} still holds the previous run's, unchanged. Try a "
                         "lower learning rate (lr).",
                         ckpt);
    return std::string("This run wrote no checkpoint yet. Try a lower learning rate (lr).");
  };
  auto save = [&](int64_t at_step) {
    if (!all_finite(model->parameters()))
      throw TrainingDiverged(
          fmt::format("{}: weights are not finite at step {}; not saving. {}", task.name(), at_step, last_good()));
    if (lead) save_checkpoint(ckpt, *model, optimizer.get(), {at_step, task.model_config(), best.into(options_json)});
    if (stale_best) {
      std::error_code ignored;  // none there is the usual case
      std::filesystem::remove(best_checkpoint_path(options.out_dir), ignored);
      stale_best = false;
    }
    result.checkpoint = ckpt;
    last_saved = at_step;
    metrics.write({{"event", "checkpoint"}, {"step", at_step}, {"path", ckpt}});
  };

  torch::Tensor perm;
  int64_t perm_epoch = -1;
  double run_seconds = 0;
  Window window, epoch_window;
  std::optional<ProgressBar> bar;
  int64_t bar_epoch = -1;

  while (step < total_steps) {
    const int64_t epoch = schedule.epoch_of(step);
    if (epoch != bar_epoch) {
      bar_epoch = epoch;
      epoch_window.clear();
      const int64_t epoch_steps = std::min(schedule.first_step(epoch + 1), total_steps) - schedule.first_step(epoch);
      const auto label = total_epochs > 1 ? fmt::format("epoch {}/{}", epoch + 1, total_epochs) : task.name();
      bar.emplace(std::cerr, label, epoch_steps, progress);
    }
    torch::Tensor ids;  // [B] int64: the examples of this step's global batch
    if (schedule.shuffle) {
      if (epoch != perm_epoch) {
        auto gen = seeded_stream(options.seed, 1, static_cast<uint64_t>(epoch));
        perm = torch::randperm(schedule.n, gen, torch::kLong);
        perm_epoch = epoch;
      }
      const int64_t begin = (step - schedule.first_step(epoch)) * options.batch_size;
      ids = perm.narrow(0, begin, std::min(options.batch_size, schedule.n - begin));
    } else {
      ids = torch::arange(step * options.batch_size, (step + 1) * options.batch_size, torch::kLong);
    }
    if (group) group->before_step(step);
    const auto t0 = Clock::now();
    task.begin_step(step, total_steps);
    auto gen = seeded_stream(options.seed, 2, static_cast<uint64_t>(step));
    Batch global = task.batch(ids, gen);
    const int64_t len = global.size();
    Batch rows = global;
    if (group) {
      // The batch (and its augmentation) is drawn whole, so each example is what it would be in one
      // process; this rank keeps its rows.
      const auto [lo, hi] = rank_slice(len, rank, world);
      rows = global.rows(lo, hi);
    }

    const double lr = options.learning_rate(step, total_steps, schedule.epochs_done(step));
    for (auto& g : optimizer->param_groups()) g.options().set_lr(lr);

    // A task that steps itself has already updated the weights here; the guard below still stops the
    // run before the next checkpoint, and save() refuses non-finite weights.
    auto loss = task.steps_itself() ? task.train_step(rows, *optimizer) : task.loss(rows);
    double loss_value = loss.total.item<double>();
    std::vector<std::pair<std::string, double>> scalars;
    for (const auto& [name, t] : loss.scalars) scalars.emplace_back(name, t.item<double>());
    if (group) {
      // Global means over the batch, so logs, metrics and the divergence check match one process.
      const double local = static_cast<double>(rows.size());
      std::vector<double> sums{loss_value * local};
      for (const auto& s : scalars) sums.push_back(s.second * local);
      std::vector<torch::Tensor> one{torch::tensor(sums, torch::kFloat64)};
      group->allreduce_sum(one);
      loss_value = one[0][0].item<double>() / len;
      for (size_t i = 0; i < scalars.size(); ++i) scalars[i].second = one[0][i + 1].item<double>() / len;
    }
    if (!std::isfinite(loss_value))
      throw TrainingDiverged(fmt::format("{}: loss is {} at step {} (epoch {}); stopping. {}", task.name(), loss_value,
                                         step, epoch + 1, last_good()));
    if (task.steps_itself()) {
      for (const auto& [name, v] : scalars)
        if (!std::isfinite(v))
          throw TrainingDiverged(fmt::format("{}: {} is {} at step {} (epoch {}); stopping. {}", task.name(), name, v,
                                             step, epoch + 1, last_good()));
    } else {
      if (group) {
        // The loss is a mean over this rank's b rows; weighting it by b * W / B before the average
        // over W ranks gives sum_r (b_r / B) grad_r, the gradient of the mean over the global batch.
        (loss.total * (static_cast<double>(rows.size()) * world / len)).backward();
        reducer->average();
      } else {
        loss.total.backward();
      }
      optimizer->step();
      // The gradients go as soon as the step has used them: the next forward, the evaluations and the
      // checkpoints between steps do not hold them (CapsNet: 33 MB in fp32, on the forward's peak).
      clear_grads(*optimizer);
    }
    ++step;

    run_seconds += seconds_since(t0);
    result.images += len;
    result.losses.push_back(loss_value);
    for (const auto& [name, v] : scalars)
      if (name == "accuracy") result.accuracies.push_back(v);
    window.add(static_cast<double>(len), loss_value, scalars);
    epoch_window.add(static_cast<double>(len), loss_value, scalars);
    const double img_s = run_seconds > 0 ? result.images / run_seconds : 0;
    bar->update(step - schedule.first_step(epoch), epoch_window.summary(img_s));

    result.out_of_time = options.max_seconds > 0 && run_seconds > options.max_seconds;
    const bool last = step == total_steps || result.out_of_time;
    if (step % options.log_every == 0 || last) {
      nlohmann::json record = {{"event", "train"},
                               {"step", step},
                               {"epoch", schedule.epochs_done(step)},
                               {"images_seen", schedule.examples_done(step)},
                               {"loss", window.mean_loss()}};
      for (const auto& [name, sum] : window.sums) record[name] = sum / window.rows;
      record["lr"] = lr;
      record["images_per_second"] = img_s;
      metrics.write(record);
      window.clear();
    }
    const bool epoch_end = last || schedule.epoch_of(step) != epoch;
    // Runs one of the task's evaluations and writes its "eval" record (rank 0 only; the caller checks lead).
    auto evaluate_split = [&](const char* split) -> std::optional<Evaluation> {
      auto* bar_stream = progress ? &std::cerr : nullptr;
      auto e = std::string(split) == "val" ? task.evaluate_validation(bar_stream) : task.evaluate(bar_stream);
      if (e) {
        nlohmann::json record = {{"event", "eval"},
                                 {"split", split},
                                 {"step", step},
                                 {"epoch", schedule.epochs_done(step)},
                                 {"train_seconds", run_seconds}};
        record.update(e->record);
        metrics.write(record);
      }
      return e;
    };
    auto evaluate_now = [&] { return evaluate_split("test"); };
    const bool epoch_evaluates = epoch_end && (options.evaluate_each_epoch || last);
    // The validation comes before the epoch's checkpoint, so that the checkpoint records the best so far
    // and best.pt can be a copy of it.
    bool new_best = false;
    if (lead && epoch_evaluates) {
      result.validation = evaluate_split("val");
      if (result.validation) new_best = best.offer(*result.validation, step);
    }
    if ((options.checkpoint_every > 0 && step % options.checkpoint_every == 0) || epoch_end) save(step);
    if (lead && new_best) {
      copy_file_atomically(ckpt, best_checkpoint_path(options.out_dir));
      metrics.write({{"event", "best"},
                     {"step", step},
                     {"epoch", schedule.epochs_done(step)},
                     {"val_accuracy", best.accuracy.value_or(0)},
                     {"path", best_checkpoint_path(options.out_dir)}});
    }
    // A mid-epoch learning-curve point; an epoch end evaluates below (when it evaluates at all).
    if (lead && options.eval_every > 0 && step % options.eval_every == 0 && !epoch_evaluates) {
      if (auto e = evaluate_now()) {
        log << fmt::format("step {} (epoch {:.3g}): {}\n", step, schedule.epochs_done(step), e->summary) << std::flush;
        result.evaluation = std::move(e);
      }
    }
    if (epoch_end) {
      bar->finish(epoch_window.summary(img_s));
      // A run that stops inside an epoch says where, rather than naming an epoch it did not finish.
      const bool whole_epoch = schedule.epoch_of(step) != epoch || schedule.first_step(epoch + 1) == step;
      std::string line = whole_epoch ? fmt::format("epoch {}: train loss {:.4f}", epoch + 1, epoch_window.mean_loss())
                                     : fmt::format("step {} (epoch {:.3g}): train loss {:.4f}", step,
                                                   schedule.epochs_done(step), epoch_window.mean_loss());
      if (auto acc = epoch_window.mean("accuracy")) line += fmt::format(" accuracy {:.2f}%", 100 * *acc);
      line += fmt::format(" ({:.0f} img/s)", img_s);
      if (lead && epoch_evaluates) {
        auto reached = [&](const Evaluation& e) {
          const auto acc = e.record.find("accuracy");
          return options.target_accuracy > 0 && acc != e.record.end() && acc->is_number() &&
                 acc->get<double>() >= options.target_accuracy;
        };
        if (result.validation) {
          line += " | " + result.validation->summary;
          if (new_best) line += " (best)";
          result.target_reached = reached(*result.validation);
        }
        if (auto e = evaluate_now()) {
          line += " | " + e->summary;
          if (!result.validation) result.target_reached = reached(*e);
          result.evaluation = std::move(e);
        }
      }
      log << line << '\n' << std::flush;
      if (group && options.target_accuracy > 0) {
        // Only rank 0 evaluates; every rank must stop at the same step.
        std::vector<torch::Tensor> flag{torch::tensor({result.target_reached ? 1.0 : 0.0}, torch::kFloat64)};
        group->allreduce_sum(flag);
        result.target_reached = flag[0].item<double>() > 0;
      }
    }
    if (result.target_reached && step < total_steps) {
      log << fmt::format("{}: stopping after step {} of {}: the target accuracy {:.2f}% is reached\n", task.name(),
                         step, total_steps, 100 * options.target_accuracy);
      break;
    }
    if (result.out_of_time) {
      log << fmt::format("{}: stopping after step {} of {}: the time budget ({:.0f} s) is spent\n", task.name(), step,
                         total_steps, options.max_seconds);
      break;
    }
  }
  result.end_step = step;
  result.best_validation_accuracy = best.accuracy;
  result.best_validation_step = best.step;
  result.seconds = run_seconds;
  result.images_per_second = run_seconds > 0 ? result.images / run_seconds : 0;
  nlohmann::json end = {
      {"event", "end"}, {"step", step}, {"seconds", run_seconds}, {"images_per_second", result.images_per_second}};
  if (best.accuracy) {
    end["best_val_accuracy"] = *best.accuracy;
    end["best_step"] = best.step;
  }
  if (options.target_accuracy > 0) {
    end["target_accuracy"] = options.target_accuracy;
    end["target_reached"] = result.target_reached;
  }
  metrics.write(end);
  return result;
}

}  // namespace capsnet::train
