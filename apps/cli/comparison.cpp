#include "apps/cli/comparison.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>

#include "apps/cli/commands.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/json_input.h"

namespace capsnet::apps::cli {

void ComparisonFlags::validate(int64_t train_images) const {
  if (target_accuracy > 0 && epochs == 0)
    throw std::invalid_argument("--target-accuracy needs --epochs (the most epochs to spend reaching it)");
  if (validation_size < 0 || validation_size >= train_images)
    throw std::invalid_argument(fmt::format("--val {} must leave training images: the training set has {}",
                                            validation_size, train_images));
  if (eval_every > 0 && validation_size == 0)
    throw std::invalid_argument("--eval-every needs --val: the points between epochs validate, never test");
  if (batch_size > train_images - validation_size)
    throw std::invalid_argument(fmt::format("--batch-size {} is larger than the {} training images", batch_size,
                                            train_images - validation_size));
}

nlohmann::json ComparisonFlags::to_json() const {
  nlohmann::json j = {{"batch_size", batch_size}, {"lr", lr}, {"seed", seed}, {"validation_size", validation_size}};
  if (eval_every > 0) j["eval_every"] = eval_every;
  if (epochs > 0) {
    j["epochs"] = epochs;
    j["lr_decay"] = lr_decay;
    j["target_accuracy"] = target_accuracy;
  } else {
    j["steps"] = steps;
  }
  return j;
}

void add_comparison_command_flags(CLI::App& app, ComparisonCommandFlags& f, const ComparisonCommandHelp& help) {
  add_data_flags(app, f.data);
  app.add_option("--out", f.out_dir, help.out)->capture_default_str();
  app.add_option("--model", f.model, help.model)
      ->check(CLI::IsMember({"capsnet", "cnn", "both"}))
      ->capture_default_str();
  add_comparison_flags(app, f.train, help.epoch_evaluation);
  app.add_option("--test-seed", f.test_seed, help.test_seed)->capture_default_str();
  app.add_option("--train-limit", f.train_limit, help.train_limit)->check(CLI::NonNegativeNumber);
  app.add_option("--test-limit", f.test_limit, help.test_limit)
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

void add_comparison_flags(CLI::App& app, ComparisonFlags& f, const std::string& epoch_evaluation) {
  app.add_option("--steps", f.steps, "Optimizer steps per model (ignored with --epochs)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  const std::string also = epoch_evaluation.empty() ? std::string(" (the test set is scored at the end only)")
                                                     : " and on " + epoch_evaluation;
  const std::string otherwise = epoch_evaluation.empty() ? std::string() : ", else on " + epoch_evaluation;
  app.add_option("--epochs", f.epochs,
                 "Train each model for up to this many epochs (0 = --steps steps), evaluating it after each on the "
                 "validation split with --val" + also)
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--target-accuracy", f.target_accuracy,
                 "With --epochs: stop a model at the first epoch whose accuracy reaches this fraction (on the "
                 "validation split with --val" + otherwise + "; 0 = train all the epochs)")
      ->capture_default_str();
  app.add_option("--lr-decay", f.lr_decay, "With --epochs: learning-rate factor per epoch, in (0, 1]")
      ->capture_default_str();
  app.add_option("--checkpoint-every", f.checkpoint_every, "Steps between checkpoints (also at epoch ends)")
      ->capture_default_str();
  app.add_option("--val", f.validation_size,
                 "Hold out the last N training images as a validation split, evaluated after every epoch; each "
                 "model is scored with its best-validation checkpoint (best.pt). 0 = none")
      ->capture_default_str();
  app.add_option("--eval-every", f.eval_every,
                 "With --val: also validate every N steps (the test set is not scored there), keeping the best as "
                 "best.pt and checking --target-accuracy there too, so a model stops near the target accuracy "
                 "rather than at the end of the epoch that passes it (0 = at epoch ends only)")
      ->capture_default_str();
  app.add_flag("--resume", f.resume,
               "Continue each model exactly from OUT/<model>/checkpoint.pt where there is one (same options); "
               "a model that reached --target-accuracy is only evaluated");
  add_training_precision_flag(app, f.precision);
  app.add_option("--batch-size", f.batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", f.lr, "Adam learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", f.seed, "Seed of initialisation and of the training images' order and placement")
      ->capture_default_str();
  app.add_option("--eval-batch-size", f.eval_batch_size, "Evaluation batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--log-every", f.log_every, "Steps between metrics records")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--no-progress", f.no_progress, "No progress bars");
  add_threads_flag(app, f.threads);
}

train::LoopOptions comparison_loop_options(const ComparisonFlags& f, const std::string& run_dir, Precision precision) {
  // One model of a comparison: --steps steps at a constant learning rate, or --epochs epochs decayed by
  // --lr-decay; the loop evaluates only at epoch ends or with a validation split (the comparison scores
  // every model on the same test sets afterwards).
  train::LoopOptions o;
  o.out_dir = run_dir;
  o.batch_size = f.batch_size;
  o.lr = f.lr;
  o.seed = f.seed;
  o.log_every = f.log_every;
  o.progress = !f.no_progress;
  o.precision = precision;
  o.checkpoint_every = f.checkpoint_every;
  o.evaluate_each_epoch = f.epochs > 0 || f.validation_size > 0;
  o.epochs = f.epochs;
  o.max_steps = f.epochs > 0 ? 0 : f.steps;
  o.lr_decay = f.epochs > 0 ? f.lr_decay : 1;
  o.target_accuracy = f.epochs > 0 ? f.target_accuracy : 0;
  o.eval_every = f.eval_every;
  o.eval_every_tests = false;
  return o;
}

SubRunLog read_sub_run(const std::string& run_dir) {
  SubRunLog log;
  std::ifstream in(train::metrics_path(run_dir));
  std::string line;
  // Each part (a "start" record) adds its training seconds. A part stopped by a signal writes no "end":
  // its seconds come from its last "train" record, whose images_per_second is this part's images over
  // its training seconds (so steps after its last checkpoint, redone by the resume, count as spent).
  double part_seconds = 0;
  int64_t part_first_image = 0;
  while (std::getline(in, line)) {
    const auto j = train::parse_json_or_discarded(line);
    if (!j.is_object() || !j.contains("event")) continue;
    const auto event = j["event"];
    if (event == "start") {
      log.seconds += part_seconds;
      part_seconds = 0;
      const auto train = j.value("train", nlohmann::json::object());
      part_first_image = j.value("step", int64_t{0}) * train.value("batch_size", int64_t{0});
      // A resume rewinds to its checkpoint: evaluations logged after that step by the interrupted part go.
      const int64_t from = j.value("step", int64_t{0});
      auto& curve = log.curve;
      while (!curve.empty() && curve.back().value("step", int64_t{0}) > from) curve.erase(curve.end() - 1);
    } else if (event == "train") {
      log.images = j.value("images_seen", log.images);
      const double rate = j.value("images_per_second", 0.0);
      if (rate > 0) part_seconds = static_cast<double>(log.images - part_first_image) / rate;
      log.final_train_accuracy = j.value("accuracy", log.final_train_accuracy);
    } else if (event == "eval") {
      log.curve.push_back({{"epoch", j.value("epoch", 0.0)},
                           {"step", j.value("step", int64_t{0})},
                           {"split", j.value("split", std::string())},
                           {"accuracy", j.value("accuracy", 0.0)}});
    } else if (event == "best") {
      log.best_step = j.value("step", int64_t{0});
      log.best_val_accuracy = j.value("val_accuracy", 0.0);
    } else if (event == "end") {
      log.step = j.value("step", log.step);
      part_seconds = j.value("seconds", part_seconds);
      log.target_reached = j.value("target_reached", false);
    }
  }
  log.seconds += part_seconds;
  return log;
}

ComparisonRun train_or_resume(train::ClassifierTask& task, const ComparisonFlags& f, const std::string& run_dir,
                              Precision precision) {
  auto o = comparison_loop_options(f, run_dir, precision);
  const auto ckpt = train::checkpoint_path(run_dir);
  const bool resuming = f.resume && std::filesystem::exists(ckpt);
  if (resuming) o.resume = ckpt;
  const auto matches = [&](const nlohmann::json& saved) { return task.config_matches(saved); };
  if (resuming && read_sub_run(run_dir).target_reached) {
    // Done in an earlier part: load its weights for the final evaluation instead of training on.
    std::cerr << fmt::format("{}: reached its target in an earlier run; loading {}\n", task.name(), ckpt);
    torch::manual_seed(o.seed);
    auto module = task.build_model(precision);
    train::load_checkpoint(ckpt, *module, nullptr, matches);
  } else {
    train::run(task, o, std::cerr);
  }
  ComparisonRun r{read_sub_run(run_dir), "last"};
  const auto best = train::best_checkpoint_path(run_dir);
  if (f.validation_size > 0 && r.log.best_step && std::filesystem::exists(best)) {
    train::load_checkpoint(best, *task.classifier().module, nullptr, matches);
    r.scored = fmt::format("best.pt (step {}, validation accuracy {:.2f}%)", *r.log.best_step,
                           100 * r.log.best_val_accuracy);
    std::cerr << fmt::format("{}: scoring {}\n", task.name(), r.scored);
  }
  return r;
}

}  // namespace capsnet::apps::cli
