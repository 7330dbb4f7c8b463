#pragma once
// The one training loop. Every experiment (MNIST classification, MultiMNIST, EM routing, SegCaps, ...)
// is a Task: it builds its model, turns example indices into a batch, computes a loss and evaluates.
// The loop owns the rest, written once: batching by (seed, step), the learning-rate schedule, Adam,
// the progress bar, JSON-lines metrics, the NaN/inf guard, atomic checkpoints with exact resume,
// data-parallel gradient averaging, numeric precision and a wall-clock budget.

#include <torch/torch.h>

#include <ATen/core/Generator.h>
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "capsnet/kernels/precision.h"

namespace capsnet::train {

class ProcessGroup;  // distributed.h
struct LoopOptions;

/// Thrown when the loss or a weight stops being finite; the last good checkpoint is kept.
class TrainingDiverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The tensors of one batch; every field's dim 0 is the example, so the loop can give each process
/// of a data-parallel job its rows without knowing what the fields mean.
struct Batch {
  std::vector<torch::Tensor> fields;
  int64_t size() const { return fields.empty() ? 0 : fields.front().size(0); }
  const torch::Tensor& operator[](size_t i) const { return fields.at(i); }
  /// Rows [begin, end) of every field.
  Batch rows(int64_t begin, int64_t end) const;
};

/// What a task's training forward pass returns.
struct TaskLoss {
  torch::Tensor total;  // scalar, mean over the batch's rows: the loop backpropagates it
  /// Named per-step scalars, each a mean over the batch's rows (e.g. {"margin_loss", ...},
  /// {"accuracy", fraction correct}); logged as window means under their names.
  std::vector<std::pair<std::string, torch::Tensor>> scalars;
};

/// One evaluation: the fields of the "eval" metrics record and the text appended to the epoch's log line.
struct Evaluation {
  nlohmann::json record;  // e.g. {"accuracy": 0.99, "error": 0.01, "loss": 0.02, "examples": 10000}
  std::string summary;    // e.g. "test loss 0.0200 accuracy 99.00% (10000 images)"
};

/// One experiment, as the loop sees it.
class Task {
 public:
  virtual ~Task() = default;
  /// Short name: the "task" field of metrics and checkpoints (a resume must match it).
  virtual std::string name() const = 0;
  /// Builds the model (once, after torch::manual_seed(seed), so initialisation is reproducible) and
  /// returns it: its parameters are optimised and it is what checkpoints hold.
  virtual std::shared_ptr<torch::nn::Module> build_model(Precision precision) = 0;
  /// The model's config as stored in checkpoints.
  virtual nlohmann::json model_config() const = 0;
  /// Whether a checkpoint's stored model config describes this task's model (default: equal JSON).
  virtual bool config_matches(const nlohmann::json& saved) const { return saved == model_config(); }
  /// Everything besides the loop's options that fixes the sequence of batches (generator seeds,
  /// augmentation, training-set size); a resume must see the same values.
  virtual nlohmann::json data_config() const = 0;
  /// The first log line's description of the model (e.g. "CapsNet: 8215568 parameters").
  virtual std::string describe() const = 0;
  /// What the loop's messages (stopping, divergence) and a one-epoch progress bar start with; default: name().
  virtual std::string label() const { return name(); }

  /// Examples in one epoch: the unit of the learning-rate decay and of end-of-epoch evaluation.
  virtual int64_t epoch_size() const = 0;
  /// true: each epoch visits the examples 0 .. epoch_size - 1 in a seeded random order and the last
  /// batch may be short. false: a stream; step s uses examples [s B, (s + 1) B), never repeating
  /// (generated data).
  virtual bool shuffle() const { return true; }
  /// Called before every training step with the step index and the total (for schedules such as the
  /// EM spread-loss margin).
  virtual void begin_step(int64_t /*step*/, int64_t /*total_steps*/) {}
  /// The global batch of examples `ids` ([B] int64); `gen` is this step's own generator (augmentation),
  /// the same on every process.
  virtual Batch batch(const torch::Tensor& ids, at::Generator& gen) const = 0;
  /// Training forward pass and loss on this process's rows of the batch.
  virtual TaskLoss loss(const Batch& rows) = 0;
  /// The optimizer (built once, after build_model; the loop sets every parameter group's learning rate
  /// each step, checkpoints and restores its state). Default nullptr: Adam over all the model's
  /// parameters with options.lr and options.weight_decay.
  virtual std::unique_ptr<torch::optim::Optimizer> make_optimizer(torch::nn::Module& /*model*/,
                                                                  const LoopOptions& /*options*/) {
    return nullptr;
  }
  /// true: the loop calls train_step instead of loss + backward + one optimizer step, for tasks whose
  /// step is several updates of parts of the model (a GAN's discriminator, then its generator).
  /// Such tasks run in one process only (no gradient averaging between their updates).
  virtual bool steps_itself() const { return false; }
  /// Only when steps_itself(): runs this step's backward passes and optimizer updates on `rows` and
  /// returns the (detached) loss and scalars to log; the NaN guard checks total and every scalar.
  virtual TaskLoss train_step(const Batch& /*rows*/, torch::optim::Optimizer& /*optimizer*/) {
    throw std::logic_error(name() + ": steps_itself() is true but train_step is not implemented");
  }
  /// Held-out evaluation, run at epoch ends and at the end; nullopt when there is nothing to evaluate.
  /// `progress` (may be null) gets a progress bar.
  virtual std::optional<Evaluation> evaluate(std::ostream* /*progress*/) { return std::nullopt; }
  /// Evaluation on a validation split held out of the training data, run before evaluate() at the same
  /// points (and at the eval_every points); nullopt when the task has none. Its record's "accuracy" (ties:
  /// lower "loss"), or for a record without accuracy its lower "loss", picks the checkpoint the loop keeps
  /// as best.pt, and the target accuracy is checked on it instead of the test
  /// set: every choice of a run is made on validation, never on test.
  virtual std::optional<Evaluation> evaluate_validation(std::ostream* /*progress*/) { return std::nullopt; }
};

/// How the learning rate moves over a run.
enum class LrSchedule {
  kExponential,  // lr * lr_decay^(periods done: epochs, or lr_decay_steps steps), smoothly per step: the paper's
  kOneCycle,     // linear warm-up from lr / 25 to lr over warmup_fraction of the run, then cosine to ~0
};

/// "exponential" | "one-cycle"; parse_lr_schedule throws std::invalid_argument naming the text.
const char* lr_schedule_name(LrSchedule schedule);
LrSchedule parse_lr_schedule(const std::string& name);

struct LoopOptions {
  std::string out_dir = "runs/train";  // checkpoint.pt and metrics.jsonl go here
  int64_t epochs = 1;
  int64_t max_steps = 0;   // > 0: stop after this many optimizer steps in total (overrides epochs)
  int64_t batch_size = 100;
  double lr = 1e-3;        // Adam
  double lr_decay = 0.96;  // multiplied into the learning rate once per decay period, applied smoothly per step
  /// The exponential schedule's decay period in steps; 0 = one epoch. Sabour et al.'s code decays by 0.96
  /// every 2,000 steps of 100 images (`capsnet train --schedule paper`).
  int64_t lr_decay_steps = 0;
  double weight_decay = 0;  // Adam's L2 term
  LrSchedule lr_schedule = LrSchedule::kExponential;
  double warmup_fraction = 0.25;  // one-cycle only: share of the run spent raising the rate
  uint64_t seed = 1;
  int64_t checkpoint_every = 500;  // steps; 0 = only at epoch ends and at the end
  int64_t log_every = 50;          // steps between "train" metric records
  bool evaluate_each_epoch = true;  // false: evaluate at the end only
  std::string resume;              // checkpoint to continue from ("" = start fresh)
  bool progress = true;
  Precision precision = Precision::kFloat32;
  double max_seconds = 0;  // > 0: stop after the first step that ends past this much training time
  /// > 0: stop after the first end-of-epoch evaluation whose "accuracy" reaches it (a fraction in
  /// (0, 1]; "train until the model reaches 99%" protocols): the validation accuracy when the task has a
  /// validation split, else the test accuracy. Not a resume key: a resume may change it.
  double target_accuracy = 0;
  /// > 0: also evaluate after every eval_every-th step (beside the epoch ends), on rank 0, with an
  /// "eval" record and a log line: a learning curve for runs measured in steps rather than epochs
  /// (generated data). 0 = only at epoch ends / the end. Not a resume key. A task with a validation
  /// split also has its target accuracy checked at these points (on the validation; a point that reaches it
  /// ends the run there, saved and tested as a last step); without one, at epoch ends only.
  int64_t eval_every = 0;
  /// false: the eval_every points validate only, without the test evaluation (a comparison that scores its
  /// models on its own test sets at the end and must not spend test time on curves). Not a resume key.
  bool eval_every_tests = true;
  /// > 0: early stopping. At each validation (epoch ends that evaluate, eval_every points) the run stops
  /// when the best validation is at least this many steps old; the stop is saved, validated and tested
  /// like a last step. Needs a task with a validation split. Not a resume key.
  int64_t patience_steps = 0;
  /// > 0 (in (0, 1), e.g. 0.999): keep an exponential moving average of the weights (weight_average.h) and
  /// evaluate it at every evaluation point, beside the trained weights: the average's validation accuracy
  /// picks best.pt, which then holds the averaged weights, and the "eval" records and log lines are the
  /// average's (the trained weights' accuracy follows as "trained_accuracy"). checkpoint.pt holds both. A
  /// resume key.
  double ema_decay = 0;

  /// Throws std::invalid_argument naming the first bad option (by field name).
  void validate() const;
  /// The options that shape the run (stored in checkpoints and the "start" record).
  nlohmann::json to_json() const;
  /// The learning rate of step `step` (0-based) of a run of `total_steps`; `epochs_done` is the
  /// fraction of epochs completed before it (the exponential schedule's exponent).
  double learning_rate(int64_t step, int64_t total_steps, double epochs_done) const;
};

struct LoopResult {
  int64_t start_step = 0, end_step = 0;
  int64_t total_steps = 0;        // planned
  double seconds = 0;             // wall time of this run's optimisation steps
  double images_per_second = 0;   // training throughput of this run
  int64_t images = 0;             // examples trained on in this run (all processes)
  std::vector<double> losses;     // total loss of every step of this run, in order
  std::vector<double> accuracies;  // the "accuracy" scalar of every step (empty when the task has none)
  std::optional<Evaluation> evaluation;  // the last one
  std::optional<Evaluation> validation;  // the last validation (tasks with a validation split)
  /// The best validation so far (this run and, after a resume, the runs before it) and its step;
  /// best.pt holds that step's checkpoint.
  std::optional<double> best_validation_accuracy;
  std::optional<double> best_validation_loss;  // the best record's "loss" (loss-only validations compare by it)
  int64_t best_validation_step = 0;
  std::string checkpoint;         // the last checkpoint written
  bool out_of_time = false;       // stopped by max_seconds
  bool target_reached = false;    // stopped by target_accuracy
  bool patience_spent = false;    // stopped by patience_steps
};

/// What an experiment's result says of its training run (each experiment's TrainResult derives from it).
struct RunStats {
  int64_t steps = 0;              // steps taken in total (including those before a resume)
  int64_t images_seen = 0;        // examples trained on by this run
  double seconds = 0;             // wall time of this run's optimisation steps
  double images_per_second = 0;   // training throughput of this run
  std::vector<double> losses;     // total loss of every step of this run, in order
  std::string checkpoint;         // the last checkpoint written (resumable)

  /// The statistics of a finished run (its losses are moved out of `r`).
  static RunStats of(LoopResult& r);
};

/// Trains `task` with Adam. Log lines go to `log` (rank 0 only), the progress bar to stderr.
/// With a `group` of W processes (data parallel, docs/distributed.md): every rank builds the same
/// global batch, takes its rank_slice of the rows, and the gradients are averaged so the update
/// equals one process's on the whole batch (up to float reassociation). Only rank 0 logs, evaluates
/// and writes files.
LoopResult run(Task& task, const LoopOptions& options, std::ostream& log,
               std::shared_ptr<ProcessGroup> group = nullptr);

/// An independent generator derived from (seed, purpose, index): the data order of an epoch and the
/// augmentation of a step are functions of the step alone, which is what makes resume exact.
at::Generator seeded_stream(uint64_t seed, uint64_t purpose, uint64_t index);

/// Path of the checkpoint / metrics file inside an output directory.
std::string checkpoint_path(const std::string& out_dir);
/// The copy of the epoch-end checkpoint with the best validation accuracy (tasks with a validation split).
std::string best_checkpoint_path(const std::string& out_dir);
std::string metrics_path(const std::string& out_dir);

/// Seconds elapsed since `start` on the steady clock.
double seconds_since(std::chrono::steady_clock::time_point start);

}  // namespace capsnet::train
