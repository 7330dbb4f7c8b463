#include "capsnet/train/loop.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>

#include "capsnet/models/capsnet.h"
#include "capsnet/kernels/adam_state.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/distributed.h"
#include "capsnet/kernels/fused_adam.h"
#include "capsnet/train/gradients.h"
#include "capsnet/train/json_input.h"
#include "capsnet/train/metrics.h"
#include "capsnet/train/weight_average.h"

namespace capsnet::train {
namespace {

// Whether `file` lies directly in `dir`, however either is spelled (false when either cannot be resolved).
bool in_directory(const std::string& file, const std::string& dir) {
  std::error_code ec;
  const auto parent = std::filesystem::absolute(file, ec).parent_path();
  if (ec) return false;
  const bool same = std::filesystem::equivalent(parent, dir, ec);
  return !ec && same;
}

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
    // The checkpoint holds names that are not UTF-8 escaped (dump_json): compare them so.
    if (saved.contains(key) && now.contains(key) && saved[key] != with_valid_utf8(now[key]))
      throw std::invalid_argument(
          fmt::format("resume from {}: option {} is {} in the checkpoint but {} now; "
                      "an exact resume needs the same value",
                      path, key, dump_json(saved[key]), dump_json(now[key])));
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

/// The best validation of a run: the highest "accuracy", ties broken by the lower "loss"; records with only
/// a "loss" (e.g. a generator's L1) by the lower loss. The first of exact ties wins. Travels in every
/// checkpoint's options, so a resume keeps it.
struct BestValidation {
  bool found = false;
  std::optional<double> accuracy;  // absent: a loss-only validation
  std::optional<double> loss;      // absent: the validation reports no loss (e.g. a classifier's accuracy only)
  int64_t step = 0;

  static std::optional<double> number(const nlohmann::json& record, const char* key) {
    const auto it = record.find(key);
    if (it != record.end() && it->is_number()) return it->get<double>();
    return std::nullopt;
  }
  /// Takes `e` when it beats the best so far; returns whether it did.
  bool offer(const Evaluation& e, int64_t at_step) {
    auto acc = number(e.record, "accuracy");
    if (acc && *acc < 0) acc.reset();
    const auto l = number(e.record, "loss");
    if (!acc && !l) return false;  // nothing to compare
    if (found) {
      if (acc && accuracy) {
        // an exact tie goes to the lower loss when both have one, else to the first
        if (*acc < *accuracy || (*acc == *accuracy && !(l && loss && *l < *loss))) return false;
      } else if (!acc && !accuracy) {
        if (!(loss && *l < *loss)) return false;
      } else {
        return false;  // a record of the other kind: the first kind stays the rule
      }
    }
    found = true;
    accuracy = acc;
    loss = l;
    step = at_step;
    return true;
  }
  /// `options` with this record under "best_validation" (absent while there is none).
  nlohmann::json into(nlohmann::json options) const {
    if (!found) return options;
    nlohmann::json j = {{"step", step}};
    if (accuracy) j["accuracy"] = *accuracy;
    if (loss) j["loss"] = *loss;
    options["best_validation"] = j;
    return options;
  }
  static BestValidation from_json(const nlohmann::json& options) {
    BestValidation b;
    if (!options.is_object() || !options.contains("best_validation")) return b;
    const auto& j = options["best_validation"];
    if (!j.is_object()) return b;
    b.accuracy = number(j, "accuracy");
    if (b.accuracy && *b.accuracy < 0) b.accuracy.reset();
    b.loss = number(j, "loss");
    b.found = b.accuracy || b.loss;
    b.step = static_cast<int64_t>(number(j, "step").value_or(0));
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
  if (patience_steps < 0) fail(fmt::format("patience_steps must be >= 0 (0 = no early stop), got {}", patience_steps));
  if (!(ema_decay == 0 || (ema_decay > 0 && ema_decay < 1)))
    fail(fmt::format("ema_decay must be in (0, 1) (0 = no weight average), got {}", ema_decay));
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
          {"precision", precision_name(precision)},
          {"out_dir", out_dir}};
  if (target_accuracy > 0) j["target_accuracy"] = target_accuracy;
  if (eval_every > 0) j["eval_every"] = eval_every;
  if (patience_steps > 0) j["patience_steps"] = patience_steps;
  j["ema_decay"] = ema_decay;
  return j;
}

namespace {

using Scalars = std::vector<std::pair<std::string, double>>;

/// One call of run(): the run's state and the named steps it is made of, in the order run() takes them.
/// Only rank 0 (`lead_`) logs, evaluates and writes files.
class LoopRun {
 public:
  LoopRun(Task& task, const LoopOptions& options, std::ostream& all_log, std::shared_ptr<ProcessGroup> group)
      : task_(task),
        options_(options),
        group_(std::move(group)),
        schedule_{task.epoch_size(), options.batch_size, task.shuffle()},
        rank_(group_ ? group_->rank() : 0),
        world_(group_ ? group_->world_size() : 1),
        lead_(rank_ == 0),
        log_(lead_ ? all_log : null_log_),
        progress_(options.progress && lead_) {}

  LoopResult run() {
    check_sizes();
    describe_options();
    build();
    resume_if_asked();
    prepare();
    write_start();
    while (step_ < total_steps_) {
      if (!one_step()) break;
    }
    return finish();
  }

 private:
  // --- before the first step ---------------------------------------------------------------------

  void check_sizes() const {
    options_.validate();
    if (schedule_.n <= 0) throw std::invalid_argument(fmt::format("{}: the training set is empty", task_.label()));
    if (world_ > 1) {
      const int64_t B = options_.batch_size;
      const int64_t last = schedule_.shuffle && schedule_.n % B != 0 ? schedule_.n % B : B;
      if (last < world_)
        throw std::invalid_argument(
            fmt::format("{} processes need at least {} examples in every batch, but batch size "
                        "{} over {} examples leaves a last batch of {}",
                        world_, world_, B, schedule_.n, last));
    }
  }

  /// The options as recorded in checkpoints and metrics, and the keys a resume must match.
  void describe_options() {
    options_json_ = options_.to_json();
    options_json_["task"] = task_.name();
    resume_keys_ = {"task",        "batch_size",   "lr",   "lr_decay", "lr_decay_steps",
                    "lr_schedule", "weight_decay", "seed", "ema_decay"};
    total_steps_ = options_.max_steps > 0 ? options_.max_steps : schedule_.total_steps(options_.epochs);
    if (options_.lr_schedule == LrSchedule::kOneCycle) {
      // The cycle spans the whole run: resuming with another length would change every later rate.
      options_json_["warmup_fraction"] = options_.warmup_fraction;
      options_json_["schedule_steps"] = total_steps_;
      resume_keys_.insert(resume_keys_.end(), {"warmup_fraction", "schedule_steps"});
    }
    const auto data_json = task_.data_config();  // items() refers into it: not a temporary
    for (const auto& [key, value] : data_json.items()) {
      options_json_[key] = value;
      resume_keys_.push_back(key);
    }
    ckpt_ = checkpoint_path(options_.out_dir);
  }

  void build() {
    torch::manual_seed(options_.seed);
    model_ = task_.build_model(options_.precision);
    if (group_ && task_.steps_itself())
      throw std::invalid_argument(
          fmt::format("{}: this task makes its own optimizer updates and runs in one process only", task_.label()));
    if (options_.ema_decay > 0) average_.emplace(*model_, options_.ema_decay);
    optimizer_ = task_.make_optimizer(*model_, options_);
    if (!optimizer_)
      optimizer_ = kernels::make_adam(model_->parameters(),
                                      torch::optim::AdamOptions(options_.lr).weight_decay(options_.weight_decay));
  }

  void resume_if_asked() {
    if (options_.resume.empty()) return;
    auto meta = read_checkpoint_meta(options_.resume);
    auto saved_options = meta.train_options;
    if (saved_options.is_object() && !saved_options.contains("lr_schedule"))
      saved_options["lr_schedule"] = "exponential";  // checkpoints from before the option had only this one
    if (saved_options.is_object() && !saved_options.contains("lr_decay_steps"))
      saved_options["lr_decay_steps"] = 0;  // before the option, the rate decayed per epoch
    if (saved_options.is_object() && !saved_options.contains("ema_decay"))
      saved_options["ema_decay"] = 0.0;  // before the option, no run averaged its weights
    check_resume_compatible(saved_options, options_json_, resume_keys_, options_.resume);
    bool average_found = false;
    step_ = load_checkpoint(
                options_.resume, *model_, optimizer_.get(),
                [&](const nlohmann::json& saved) { return task_.config_matches(saved); },
                average_ ? &average_->tensors() : nullptr, &average_found)
                .step;
    // ema_decay is a resume key, so only a damaged or hand-made file gets here without its average.
    if (average_ && !average_found)
      throw CheckpointError(
          fmt::format("checkpoint {}: holds no weight average (ema_decay {}), so the run cannot "
                      "continue exactly",
                      options_.resume, options_.ema_decay));
    log_ << fmt::format("resumed from {} at step {}\n", options_.resume, step_);
    best_ = BestValidation::from_json(meta.train_options);
  }

  void prepare() {
    kernels::allocate_adam_state(*optimizer_);  // before the first forward: lower peak memory (adam_state.h)
    clear_grads(*optimizer_);                    // every step starts without gradients (see train_on below)
    model_->train();
    if (group_) {
      // The same seed already gives every rank the same weights; the broadcast also covers resumes
      // and anything else that could make rank 0's state the only one to trust.
      broadcast_parameters(*group_, model_->parameters());
      reducer_.emplace(group_, model_->parameters());
    }
    total_epochs_ = schedule_.epoch_of(total_steps_ - 1) + 1;
    result_.start_step = step_;
    result_.total_steps = total_steps_;
    result_.checkpoint = options_.resume;
    last_saved_ = step_;
    // Not resuming, a checkpoint already in out_dir is a previous run's (the caller chose to replace
    // it): it stays until this run saves its own, and a divergence before that says so.
    std::error_code exists_error;
    previous_checkpoint_ = options_.resume.empty() && std::filesystem::exists(ckpt_, exists_error);
    // A fresh run's first checkpoint replaces the previous run's; its best.pt goes with it. So does the
    // best.pt of a folder that continues another folder's run: it belongs to neither.
    stale_best_ = lead_ && (options_.resume.empty() || !in_directory(options_.resume, options_.out_dir));
  }

  void write_start() {
    if (lead_) metrics_ = JsonLinesWriter(metrics_path(options_.out_dir), /*truncate=*/options_.resume.empty());
    const int64_t parameters = models::count_parameters(*model_);
    metrics_.write({{"event", "start"},
                    {"task", task_.name()},
                    {"step", step_},
                    {"model", task_.model_config()},
                    {"train", options_json_},
                    {"parameters", parameters},
                    {"threads", at::get_num_threads()}});
    log_ << fmt::format(
        "{}: {} parameters, {} examples per epoch, batch {}, {} steps ({} per epoch), {} threads, {} "
        "compute\n",
        task_.describe(), parameters, schedule_.n, options_.batch_size, total_steps_, schedule_.first_step(1),
        at::get_num_threads(), precision_name(options_.precision));
    if (group_)
      log_ << fmt::format("data parallel: {} processes, {} examples each per step, {} gradient buckets\n", world_,
                          options_.batch_size / world_, reducer_->bucket_count());
  }

  // --- one step ------------------------------------------------------------------------------------

  /// Trains step_ and does what falls after it (records, evaluations, checkpoints, the epoch's line).
  /// false: the run stops here (target accuracy or time budget).
  bool one_step() {
    const int64_t epoch = schedule_.epoch_of(step_);
    if (epoch != bar_epoch_) begin_epoch(epoch);
    const torch::Tensor ids = batch_ids(epoch);  // [B] int64
    if (group_) group_->before_step(step_);
    const auto t0 = Clock::now();
    task_.begin_step(step_, total_steps_);
    auto gen = seeded_stream(options_.seed, 2, static_cast<uint64_t>(step_));
    const Batch global = task_.batch(ids, gen);
    const int64_t len = global.size();
    Batch rows = global;
    if (group_) {
      // The batch (and its augmentation) is drawn whole, so each example is what it would be in one
      // process; this rank keeps its rows.
      const auto [lo, hi] = rank_slice(len, rank_, world_);
      rows = global.rows(lo, hi);
    }
    const double lr = options_.learning_rate(step_, total_steps_, schedule_.epochs_done(step_));
    for (auto& g : optimizer_->param_groups()) g.options().set_lr(lr);
    Scalars scalars;
    const double loss_value = train_on(rows, len, epoch, scalars);
    ++step_;
    if (average_) average_->update(step_);

    run_seconds_ += seconds_since(t0);
    result_.images += len;
    result_.losses.push_back(loss_value);
    for (const auto& [name, v] : scalars)
      if (name == "accuracy") result_.accuracies.push_back(v);
    window_.add(static_cast<double>(len), loss_value, scalars);
    epoch_window_.add(static_cast<double>(len), loss_value, scalars);
    const double img_s = images_per_second();
    bar_->update(step_ - schedule_.first_step(epoch), epoch_window_.summary(img_s));

    result_.out_of_time = options_.max_seconds > 0 && run_seconds_ > options_.max_seconds;
    const bool last = step_ == total_steps_ || result_.out_of_time;
    if (step_ % options_.log_every == 0 || last) write_train_record(lr, img_s);
    const bool epoch_end = last || schedule_.epoch_of(step_) != epoch;
    after_step(epoch, epoch_end, last, img_s);
    return !should_stop();
  }

  void begin_epoch(int64_t epoch) {
    bar_epoch_ = epoch;
    epoch_window_.clear();
    const int64_t epoch_steps = std::min(schedule_.first_step(epoch + 1), total_steps_) - schedule_.first_step(epoch);
    const auto label = total_epochs_ > 1 ? fmt::format("epoch {}/{}", epoch + 1, total_epochs_) : task_.label();
    bar_.emplace(std::cerr, label, epoch_steps, progress_);
  }

  /// ids: [B] int64, the examples of step_'s global batch: a slice of the epoch's seeded permutation, or
  /// [s B, (s + 1) B) of a stream.
  torch::Tensor batch_ids(int64_t epoch) {
    if (!schedule_.shuffle)
      return torch::arange(step_ * options_.batch_size, (step_ + 1) * options_.batch_size, torch::kLong);
    if (epoch != perm_epoch_) {
      auto gen = seeded_stream(options_.seed, 1, static_cast<uint64_t>(epoch));
      perm_ = torch::randperm(schedule_.n, gen, torch::kLong);
      perm_epoch_ = epoch;
    }
    const int64_t begin = (step_ - schedule_.first_step(epoch)) * options_.batch_size;
    return perm_.narrow(0, begin, std::min(options_.batch_size, schedule_.n - begin));
  }

  /// The loss of `rows` (this rank's share of a global batch of len), its gradient and the update; returns
  /// the loss and the task's scalars as means over the global batch. Throws TrainingDiverged on a
  /// non-finite loss.
  double train_on(const Batch& rows, int64_t len, int64_t epoch, Scalars& scalars) {
    // A task that steps itself has already updated the weights here; the check below still stops the
    // run before the next checkpoint, and save() refuses non-finite weights.
    auto loss = task_.steps_itself() ? task_.train_step(rows, *optimizer_) : task_.loss(rows);
    double loss_value = loss.total.item<double>();
    for (const auto& [name, t] : loss.scalars) scalars.emplace_back(name, t.item<double>());
    if (group_) {
      // Global means over the batch, so logs, metrics and the divergence check match one process.
      const double local = static_cast<double>(rows.size());
      std::vector<double> sums{loss_value * local};
      for (const auto& s : scalars) sums.push_back(s.second * local);
      std::vector<torch::Tensor> one{torch::tensor(sums, torch::kFloat64)};
      group_->allreduce_sum(one);
      loss_value = one[0][0].item<double>() / len;
      for (size_t i = 0; i < scalars.size(); ++i) scalars[i].second = one[0][i + 1].item<double>() / len;
    }
    if (!std::isfinite(loss_value))
      throw TrainingDiverged(fmt::format("{}: loss is {} at step {} (epoch {}); stopping. {}", task_.label(),
                                         loss_value, step_, epoch + 1, last_good()));
    if (task_.steps_itself()) {
      for (const auto& [name, v] : scalars)
        if (!std::isfinite(v))
          throw TrainingDiverged(fmt::format("{}: {} is {} at step {} (epoch {}); stopping. {}", task_.label(), name,
                                             v, step_, epoch + 1, last_good()));
      return loss_value;
    }
    if (group_) {
      // The loss is a mean over this rank's b rows; weighting it by b * W / B before the average
      // over W ranks gives sum_r (b_r / B) grad_r, the gradient of the mean over the global batch.
      (loss.total * (static_cast<double>(rows.size()) * world_ / len)).backward();
      reducer_->average();
    } else {
      loss.total.backward();
    }
    optimizer_->step();
    // The gradients go as soon as the step has used them: the next forward, the evaluations and the
    // checkpoints between steps do not hold them (CapsNet: 33 MB in fp32, on the forward's peak).
    clear_grads(*optimizer_);
    return loss_value;
  }

  double images_per_second() const { return run_seconds_ > 0 ? result_.images / run_seconds_ : 0; }

  void write_train_record(double lr, double img_s) {
    nlohmann::json record = {{"event", "train"},
                             {"step", step_},
                             {"epoch", schedule_.epochs_done(step_)},
                             {"images_seen", schedule_.examples_done(step_)},
                             {"loss", window_.mean_loss()}};
    for (const auto& [name, sum] : window_.sums) record[name] = sum / window_.rows;
    record["lr"] = lr;
    record["images_per_second"] = img_s;
    metrics_.write(record);
    window_.clear();
  }

  /// Evaluations, checkpoint, best.pt and the epoch's line after step_.
  void after_step(int64_t epoch, bool epoch_end, bool last, double img_s) {
    bool epoch_evaluates = epoch_end && (options_.evaluate_each_epoch || last);
    const bool mid_point = options_.eval_every > 0 && step_ % options_.eval_every == 0 && !epoch_evaluates;
    // The validation comes before the checkpoint, so that the checkpoint records the best so far and
    // best.pt can be a copy of it. Validations run at the epoch ends that evaluate and at the eval_every
    // points; a new best at a mid-epoch point is saved there.
    bool new_best = false, validated_here = false;
    if (lead_ && (epoch_evaluates || mid_point)) {
      auto v = evaluate_split("val");
      if (v) new_best = best_.offer(*v, step_);
      validated_here = v.has_value();
      if (v || epoch_evaluates) result_.validation = std::move(v);
    }
    if (epoch_evaluates || mid_point) check_patience();
    if (mid_point && options_.target_accuracy > 0)
      result_.target_reached = everyone_knows(validated_here && reached_target(*result_.validation));
    if ((result_.patience_spent || result_.target_reached) && !epoch_end) {
      // The run ends here: save, evaluate and report as at a last step.
      epoch_end = true;
      epoch_evaluates = true;
    }
    if ((options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0) || epoch_end || new_best) save();
    if (lead_ && new_best) {
      if (average_) {
        // best.pt holds the weights the validation chose: the average (and, as a checkpoint, the rest).
        WeightAverage::Swap averaged(*average_);
        auto options = best_.into(options_json_);
        options["weights"] = "average";
        save_checkpoint(best_checkpoint_path(options_.out_dir), *model_, optimizer_.get(),
                        {step_, task_.model_config(), options}, average_->tensors());
      } else {
        copy_file_atomically(ckpt_, best_checkpoint_path(options_.out_dir));
      }
      metrics_.write({{"event", "best"},
                      {"step", step_},
                      {"epoch", schedule_.epochs_done(step_)},
                      {best_.accuracy ? "val_accuracy" : "val_loss", best_.accuracy ? *best_.accuracy : *best_.loss},
                      {"path", best_checkpoint_path(options_.out_dir)}});
    }
    // A mid-epoch learning-curve point; an epoch end evaluates below (when it evaluates at all).
    if (lead_ && mid_point && !epoch_evaluates && options_.eval_every_tests) {
      if (auto e = evaluate_split("test")) {
        log_ << fmt::format("step {} (epoch {:.3g}): {}\n", step_, schedule_.epochs_done(step_), e->summary)
             << std::flush;
        result_.evaluation = std::move(e);
      }
    }
    if (epoch_end) end_epoch(epoch, epoch_evaluates, new_best, img_s);
  }

  /// Runs one of the task's evaluations and writes its "eval" record (rank 0 only; the caller checks lead_).
  /// With a weight average, the evaluation is the average's, and the trained weights' accuracy (or loss)
  /// follows in the record as "trained_accuracy" ("trained_loss") and at the end of the summary. The trained
  /// weights go first, so that the average's is the task's last evaluation (what its result reports).
  std::optional<Evaluation> evaluate_split(const char* split) {
    auto* bar_stream = progress_ ? &std::cerr : nullptr;
    auto evaluate = [&] {
      return std::string(split) == "val" ? task_.evaluate_validation(bar_stream) : task_.evaluate(bar_stream);
    };
    const auto trained = average_ ? evaluate() : std::nullopt;
    std::optional<WeightAverage::Swap> averaged;  // the average in the model for this evaluation only
    if (average_) averaged.emplace(*average_);
    auto e = evaluate();
    averaged.reset();
    if (e) {
      nlohmann::json record = {{"event", "eval"},
                               {"split", split},
                               {"step", step_},
                               {"epoch", schedule_.epochs_done(step_)},
                               {"train_seconds", run_seconds_}};
      record.update(e->record);
      if (average_) {
        record["weights"] = "average";
        std::string note = " [weight average";
        const auto& t = trained ? trained->record : nlohmann::json::object();
        if (const auto acc = BestValidation::number(t, "accuracy")) {
          record["trained_accuracy"] = *acc;
          note += fmt::format("; trained weights {:.2f}%", 100 * *acc);
        }
        if (const auto loss = BestValidation::number(t, "loss")) record["trained_loss"] = *loss;
        e->summary += note + "]";
      }
      metrics_.write(record);
    }
    return e;
  }

  /// Early stop: the best validation is patience_steps old (or older) at this validation point. Every rank
  /// reaches the same points and learns rank 0's verdict.
  void check_patience() {
    if (options_.patience_steps <= 0) return;
    result_.patience_spent =
        everyone_knows(lead_ && best_.found && step_ - best_.step >= options_.patience_steps && step_ < total_steps_);
  }

  /// Rank 0's decision, on every rank (only rank 0 evaluates; every rank must stop at the same step). Every
  /// rank must call it at the same points.
  bool everyone_knows(bool lead_decision) const {
    if (!group_) return lead_decision;
    std::vector<torch::Tensor> flag{torch::tensor({lead_decision ? 1.0 : 0.0}, torch::kFloat64)};
    group_->allreduce_sum(flag);
    return flag[0].item<double>() > 0;
  }

  bool reached_target(const Evaluation& e) const {
    const auto acc = e.record.find("accuracy");
    return options_.target_accuracy > 0 && acc != e.record.end() && acc->is_number() &&
           acc->get<double>() >= options_.target_accuracy;
  }

  /// The epoch's line (train, then validation and test when it evaluates) and the target check.
  void end_epoch(int64_t epoch, bool evaluates, bool new_best, double img_s) {
    bar_->finish(epoch_window_.summary(img_s));
    // A run that stops inside an epoch says where, rather than naming an epoch it did not finish.
    const bool whole_epoch = schedule_.epoch_of(step_) != epoch || schedule_.first_step(epoch + 1) == step_;
    std::string line = whole_epoch ? fmt::format("epoch {}: train loss {:.4f}", epoch + 1, epoch_window_.mean_loss())
                                   : fmt::format("step {} (epoch {:.3g}): train loss {:.4f}", step_,
                                                 schedule_.epochs_done(step_), epoch_window_.mean_loss());
    if (auto acc = epoch_window_.mean("accuracy")) line += fmt::format(" accuracy {:.2f}%", 100 * *acc);
    line += fmt::format(" ({:.0f} img/s)", img_s);
    if (lead_ && evaluates) {
      if (result_.validation) {
        line += " | " + result_.validation->summary;
        if (new_best) line += " (best)";
        result_.target_reached = reached_target(*result_.validation);
      }
      if (auto e = evaluate_split("test")) {
        line += " | " + e->summary;
        if (!result_.validation) result_.target_reached = reached_target(*e);
        result_.evaluation = std::move(e);
      }
    }
    log_ << line << '\n' << std::flush;
    if (options_.target_accuracy > 0) result_.target_reached = everyone_knows(result_.target_reached);
  }

  bool should_stop() {
    if (result_.patience_spent) {
      log_ << fmt::format(
          "{}: stopping after step {} of {}: no better validation for {} steps (patience {}; best at step {})\n",
          task_.label(), step_, total_steps_, step_ - best_.step, options_.patience_steps, best_.step);
      return true;
    }
    if (result_.target_reached && step_ < total_steps_) {
      log_ << fmt::format("{}: stopping after step {} of {}: the target accuracy {:.2f}% is reached\n", task_.label(),
                          step_, total_steps_, 100 * options_.target_accuracy);
      return true;
    }
    if (result_.out_of_time) {
      log_ << fmt::format("{}: stopping after step {} of {}: the time budget ({:.0f} s) is spent\n", task_.label(),
                          step_, total_steps_, options_.max_seconds);
      return true;
    }
    return false;
  }

  // --- checkpoints -----------------------------------------------------------------------------------

  /// What is on disk to go back to, for a divergence message.
  std::string last_good() const {
    if (!result_.checkpoint.empty())
      return fmt::format("The last good checkpoint is {} (step {}). Try a lower learning rate (lr).",
                         result_.checkpoint, last_saved_);
    if (previous_checkpoint_)
      return fmt::format("This run wrote no checkpoint yet; {} still holds the previous run's, unchanged. Try a "
                         "lower learning rate (lr).",
                         ckpt_);
    return "This run wrote no checkpoint yet. Try a lower learning rate (lr).";
  }

  void save() {
    if (!all_finite(model_->parameters()))
      throw TrainingDiverged(
          fmt::format("{}: weights are not finite at step {}; not saving. {}", task_.label(), step_, last_good()));
    if (lead_)
      save_checkpoint(ckpt_, *model_, optimizer_.get(), {step_, task_.model_config(), best_.into(options_json_)},
                      average_ ? average_->tensors() : NamedTensors{});
    if (stale_best_) {
      std::error_code ignored;  // none there is the usual case
      std::filesystem::remove(best_checkpoint_path(options_.out_dir), ignored);
      stale_best_ = false;
    }
    result_.checkpoint = ckpt_;
    last_saved_ = step_;
    metrics_.write({{"event", "checkpoint"}, {"step", step_}, {"path", ckpt_}});
  }

  // --- after the last step ---------------------------------------------------------------------------

  LoopResult finish() {
    result_.end_step = step_;
    result_.best_validation_accuracy = best_.accuracy;
    result_.best_validation_loss = best_.loss;
    result_.best_validation_step = best_.step;
    result_.seconds = run_seconds_;
    result_.images_per_second = images_per_second();
    nlohmann::json end = {
        {"event", "end"}, {"step", step_}, {"seconds", run_seconds_}, {"images_per_second", result_.images_per_second}};
    if (best_.found) {
      if (best_.accuracy) end["best_val_accuracy"] = *best_.accuracy;
      if (best_.loss) end["best_val_loss"] = *best_.loss;
      end["best_step"] = best_.step;
    }
    if (options_.patience_steps > 0) end["patience_spent"] = result_.patience_spent;
    if (options_.target_accuracy > 0) {
      end["target_accuracy"] = options_.target_accuracy;
      end["target_reached"] = result_.target_reached;
    }
    metrics_.write(end);
    return std::move(result_);
  }

  Task& task_;
  const LoopOptions& options_;
  std::shared_ptr<ProcessGroup> group_;
  const Schedule schedule_;
  const int rank_, world_;
  const bool lead_;  // the one rank that logs, evaluates and writes files
  std::ostream null_log_{nullptr};
  std::ostream& log_;
  const bool progress_;

  nlohmann::json options_json_;
  std::vector<std::string> resume_keys_;
  int64_t total_steps_ = 0, total_epochs_ = 0;
  std::string ckpt_;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::optional<WeightAverage> average_;  // options_.ema_decay > 0
  std::optional<GradientReducer> reducer_;
  JsonLinesWriter metrics_;  // not open on ranks other than 0: writes nothing

  int64_t step_ = 0;
  BestValidation best_;
  LoopResult result_;
  int64_t last_saved_ = 0;
  bool previous_checkpoint_ = false, stale_best_ = false;

  torch::Tensor perm_;  // [n] int64: the current epoch's order (shuffled tasks)
  int64_t perm_epoch_ = -1;
  double run_seconds_ = 0;
  Window window_, epoch_window_;
  std::optional<ProgressBar> bar_;
  int64_t bar_epoch_ = -1;
};

}  // namespace

LoopResult run(Task& task, const LoopOptions& options, std::ostream& log, std::shared_ptr<ProcessGroup> group) {
  return LoopRun(task, options, log, std::move(group)).run();
}

RunStats RunStats::of(LoopResult& r) {
  RunStats s;
  s.steps = r.end_step;
  s.images_seen = r.images;
  s.seconds = r.seconds;
  s.images_per_second = r.images_per_second;
  s.losses = std::move(r.losses);
  s.checkpoint = r.checkpoint;
  return s;
}

}  // namespace capsnet::train
