#pragma once
// What the model-comparison commands (capsnet affine, capsnet stn) share: each trains several classifiers
// on the same data with the same budget, each in OUT/<model>/ by the one loop, and scores them all on the
// same test sets. Their training flags are declared here once; so is the per-model run (fresh, resumed,
// or already finished) and the choice of the checkpoint that is scored.

#include <CLI/CLI.hpp>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "capsnet/train/classifier_task.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/train/loop.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

struct ComparisonFlags {
  std::string precision = "auto";
  int64_t steps = 200;             // steps per model without --epochs
  int64_t epochs = 0;              // > 0: whole epochs, evaluated after each
  int64_t batch_size = 32, eval_batch_size = 100, log_every = 25, checkpoint_every = 500;
  int64_t validation_size = 0;     // the last N training images are held out as a validation split
  int64_t eval_every = 0;          // > 0 (with --val): also validate every N steps, the target checked there
  double lr = 1e-3, lr_decay = 1, target_accuracy = 0;
  uint64_t seed = 1;
  bool resume = false, no_progress = false;
  int threads = 0;

  /// Throws std::invalid_argument naming the first bad combination; `train_images` is the training set's
  /// size before the validation split is taken from it.
  void validate(int64_t train_images) const;
  /// The options that shape every model's run, for the comparison's "start" record and report.
  nlohmann::json to_json() const;
};

/// Registers --steps, --epochs, --target-accuracy, --lr-decay, --checkpoint-every, --val, --eval-every, --resume,
/// --precision, --batch-size, --lr, --seed, --eval-batch-size, --log-every, --no-progress and --threads
/// with the values already in `f` as their defaults. `epoch_evaluation` names what is evaluated after
/// each epoch besides the validation split (e.g. "the translated test set"; empty: nothing, the test set is
/// scored at the end only).
void add_comparison_flags(CLI::App& app, ComparisonFlags& f, const std::string& epoch_evaluation);

/// What both comparison commands hold besides their training flags: data, output, which models, the
/// training and test image limits and the seed of the generated test set(s).
struct ComparisonCommandFlags {
  DataFlags data;
  ComparisonFlags train;
  std::string out_dir, model = "both";
  int64_t train_limit = 0, test_limit = 2000;
  uint64_t test_seed = 0;
};

/// How a comparison command describes the flags add_comparison_command_flags registers.
struct ComparisonCommandHelp {
  std::string out, model, test_seed, train_limit, test_limit;
  std::string epoch_evaluation;  // as add_comparison_flags
};

/// Registers the data flags, --out, --model (capsnet, cnn or both), the training flags
/// (add_comparison_flags), --test-seed, --train-limit and --test-limit.
void add_comparison_command_flags(CLI::App& app, ComparisonCommandFlags& f, const ComparisonCommandHelp& help);

/// The loop options of one model: `steps` steps at a constant rate, or whole epochs (learning rate
/// × lr_decay per epoch, evaluated after each, stopping at the target accuracy). With a validation split
/// the validation is evaluated at every epoch end in both modes, and the best epoch is kept as best.pt.
train::LoopOptions comparison_loop_options(const ComparisonFlags& f, const std::string& run_dir, Precision precision);

/// What a model's run directory says about its training so far (all its resumed parts together).
struct SubRunLog {
  int64_t step = 0, images = 0;
  double seconds = 0;
  bool target_reached = false;
  nlohmann::json curve = nlohmann::json::array();  // [{epoch, step, split, accuracy}] of the loop's evaluations
  std::optional<int64_t> best_step;                // the best validation epoch's step (best.pt), if any
  double best_val_accuracy = 0;
  double final_train_accuracy = 0;                 // the last "train" record's window accuracy
};
SubRunLog read_sub_run(const std::string& run_dir);

/// Trains `task` in `run_dir` (continuing exactly from its checkpoint with --resume; a model that already
/// reached its target accuracy is loaded, not trained on), then, when a validation split chose a best
/// epoch, loads best.pt: the model a comparison scores is the one the validation picked, never one
/// picked on a test set. Returns the run's log, with `scored` naming the weights now in the model.
struct ComparisonRun {
  SubRunLog log;
  std::string scored;  // "last" or "best.pt (step N, validation accuracy A)"
};
ComparisonRun train_or_resume(train::ClassifierTask& task, const ComparisonFlags& f, const std::string& run_dir,
                              Precision precision);

}  // namespace capsnet::apps::cli
