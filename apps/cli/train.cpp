#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>

#include "capsnet/data/mnist.h"
#include "capsnet/train/distributed.h"
#include "capsnet/train/trainer.h"
#include "apps/cli/commands.h"
#include "apps/cli/loop_flags.h"

namespace capsnet::apps::cli {
namespace {

/// `--schedule` presets: the values of the flags a user did not give. "paper" is the authors' recipe as
/// their public code runs it (Adam 1e-3, batch 100, the rate x0.96 every 2,000 steps); "fast" is the
/// one-cycle recipe measured to reach 99.5% on MNIST in the fewest epochs (docs/results.md).
struct SchedulePreset {
  train::LrSchedule lr_schedule;
  double lr;  // peak for one-cycle
  int64_t lr_decay_steps;  // exponential only
  int64_t batch_size;
  int64_t epochs;
};

SchedulePreset schedule_preset(const std::string& name) {
  if (name == "paper") return {train::LrSchedule::kExponential, 1e-3, 2000, 100, 1};
  return {train::LrSchedule::kOneCycle, 3e-3, 0, 100, 5};  // "fast" (the flag's check admits nothing else)
}

struct TrainFlags {
  train::TrainOptions o;
  std::string precision;  // --precision, parsed into o.loop.precision
  DataFlags data;
  int64_t train_limit = 0, test_limit = 0;
  bool no_reconstruction = false, stop_routing_grad = false, no_eval = false, composite_routing = false;
  std::string schedule = "paper", lr_schedule;
  LoopFlags loop;
};

void add_train_flags(CLI::App& app, TrainFlags& f) {
  add_data_flags(app, f.data);
  add_image_folder_flags(app, f.data, /*training=*/true);
  app.add_option("--out", f.o.loop.out_dir, "Output directory (checkpoint.pt, metrics.jsonl)")->capture_default_str();
  app.add_option("--epochs", f.o.loop.epochs, "Epochs")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--steps", f.o.loop.max_steps, "Total optimizer steps (overrides --epochs when > 0)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch-size", f.o.loop.batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr", f.o.loop.lr, "Adam learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--lr-decay", f.o.loop.lr_decay, "Learning-rate factor per decay period (--lr-decay-steps), in (0, 1]")
      ->check(CLI::Range(1e-9, 1.0))
      ->capture_default_str();
  app.add_option("--lr-decay-steps", f.o.loop.lr_decay_steps,
                 "Exponential schedule's decay period in steps (0 = one epoch; --schedule paper: 2000)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--val", f.o.validation_size,
                 "Hold out the last N training images as a validation split: evaluated every epoch beside the "
                 "test set, the best epoch kept as best.pt (0 = none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--ema-decay", f.o.loop.ema_decay,
                 "Keep an exponential moving average of the weights with this decay (e.g. 0.999; 0 = none): it is "
                 "what is evaluated, chosen by --val and kept in best.pt; the trained weights' accuracy is shown "
                 "beside it")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
  app.add_option("--schedule", f.schedule,
                 "Training recipe: paper (the authors' code: Adam 1e-3, x0.96 every 2,000 steps, 1 epoch unless "
                 "--epochs) or fast (one-cycle to 3e-3 over 5 epochs unless --epochs); explicit flags override it")
      ->check(CLI::IsMember({"paper", "fast"}))
      ->capture_default_str();
  app.add_option("--lr-schedule", f.lr_schedule,
                 "exponential (--lr x --lr-decay per epoch) or one-cycle (warm-up to --lr, cosine to ~0 at the end)")
      ->check(CLI::IsMember({"exponential", "one-cycle"}));
  app.add_option("--warmup-fraction", f.o.loop.warmup_fraction,
                 "One-cycle: share of the run spent warming up, in [0, 1)")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  app.add_option("--routing-iters", f.o.model.routing_iterations, "Dynamic routing iterations r")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--conv1-channels", f.o.model.conv1_channels, "Conv1 channels (paper: 256)")->capture_default_str();
  app.add_option("--primary-types", f.o.model.primary_types,
                 "PrimaryCaps capsule types (paper: 32 for MNIST, 64 for CIFAR-10)")
      ->capture_default_str();
  app.add_flag("--stop-routing-grad", f.stop_routing_grad,
               "Treat coupling coefficients c_ij as constants in backprop (default: full gradient)");
  app.add_flag("--composite-routing", f.composite_routing,
               "Route with plain tensor ops instead of the fused operator (same math; slower, more memory)");
  add_training_precision_flag(app, f.precision);
  auto* no_reconstruction =
      app.add_flag("--no-reconstruction", f.no_reconstruction, "No decoder and no reconstruction loss");
  app.add_option("--recon-weight", f.o.model.reconstruction_scale,
                 "Weight of the reconstruction loss (sum of squared pixel errors) beside the margin loss summed over "
                 "classes: 0.0005 as the paper states. The authors' code averages a halved margin loss over the 10 "
                 "classes (0.05x the paper's), so it trains the equivalent of 0.01")
      ->check(CLI::Range(0.0, 1e6))
      ->excludes(no_reconstruction)
      ->capture_default_str();
  app.add_option("--init", f.o.model.init,
                 "Initialisation: torch (LibTorch's defaults, DigitCaps W ~ N(0, 0.01^2)) or authors (the authors' "
                 "code: truncated normals, biases 0.1, PrimaryCaps divided by its number of types; docs/results.md)")
      ->check(CLI::IsMember({"torch", "authors"}))
      ->capture_default_str();
  app.add_flag("--stn", f.o.model.stn, "Spatial transformer in front of the CapsNet (identity at init)");
  app.add_option("--max-shift", f.o.max_shift, "Random shift augmentation, pixels")
      ->check(CLI::Range(0, 27))
      ->capture_default_str();
  app.add_flag("--hflip", f.o.hflip,
               "Mirror each training image left-right with probability 1/2 (for mirror-symmetric classes such as "
               "Fashion-MNIST's; not for digits)");
  app.add_option("--seed", f.o.loop.seed, "Random seed (init, data order, shifts)")->capture_default_str();
  app.add_option("--train-limit", f.train_limit, "Use only the first N training images (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--test-limit", f.test_limit, "Evaluate on the first N test images (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-every", f.o.loop.checkpoint_every, "Steps between checkpoints (also at epoch ends)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-every", f.o.loop.log_every, "Steps between metrics records")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--no-eval", f.no_eval, "Skip the test-set evaluation at epoch ends");
  add_loop_flags(app, f.loop);
}

/// The recipe's defaults where no flag set them, and the flags that say what the model and loop do.
void apply_train_flags(TrainFlags& f, const CLI::App& app) {
  f.o.loop.precision = precision_from_flag(f.precision);
  const auto preset = schedule_preset(f.schedule);
  f.o.loop.lr_schedule = f.lr_schedule.empty() ? preset.lr_schedule : train::parse_lr_schedule(f.lr_schedule);
  if (!app.count("--lr")) f.o.loop.lr = preset.lr;
  if (!app.count("--lr-decay-steps")) f.o.loop.lr_decay_steps = preset.lr_decay_steps;
  if (!app.count("--batch-size")) f.o.loop.batch_size = preset.batch_size;
  if (!app.count("--epochs")) f.o.loop.epochs = preset.epochs;
  f.o.model.reconstruction = !f.no_reconstruction;
  f.o.model.grad_through_routing = !f.stop_routing_grad;
  f.o.loop.evaluate_each_epoch = !f.no_eval;
  f.o.fused_routing = !f.composite_routing;
  f.o.loop.progress = !f.loop.no_progress;
  f.o.loop.resume = f.loop.resume;
  f.o.validate();  // before loading 50 MB of data
  if (!f.data.is_folder() && f.data.folder.image_size > 0)
    throw std::invalid_argument("--image-size applies to image folders (--data DIR/<class>/...)");
}

/// What a finished run prints: the speed, the last test and validation accuracy, where its files are.
void report_training(const TrainFlags& f, const train::TrainResult& r) {
  std::cout << fmt::format("trained steps {}..{} in {:.1f} s ({:.1f} img/s)\n", r.start_step, r.steps, r.seconds,
                           r.images_per_second);
  const std::string weights = f.o.loop.ema_decay > 0 ? " (weight average)" : "";
  if (r.test)
    std::cout << fmt::format("test accuracy{}: {:.2f}% (error {:.2f}%) on {} images\n", weights, 100 * r.test->accuracy,
                             100 * (1 - r.test->accuracy), r.test->examples);
  if (r.validation)
    std::cout << fmt::format("validation accuracy{}: {:.2f}% on {} images; best {:.2f}% at step {} ({})\n", weights,
                             100 * r.validation->accuracy, r.validation->examples,
                             100 * r.best_validation_accuracy.value_or(0), r.best_validation_step,
                             train::best_checkpoint_path(f.o.loop.out_dir));
  std::cout << fmt::format("checkpoint: {}\nmetrics: {}\n", r.checkpoint, train::metrics_path(f.o.loop.out_dir));
}

/// One process's (or one rank's) training run: the data, the loop, the report (rank 0).
int run_train(TrainFlags& f, std::shared_ptr<train::ProcessGroup> group) {
  std::ostream null_log(nullptr);
  auto data = load_labelled_data(f.data, true, !f.no_eval, f.train_limit, f.test_limit,
                                 group && group->rank() != 0 ? null_log : std::cout);
  if (data.folder) {  // the model takes the folder's shape and classes
    f.o.model.image_channels = data.channels;
    f.o.model.image_size = data.side;
    f.o.model.num_classes = static_cast<int64_t>(data.class_names.size());
    f.o.data_info = {{"dataset", "image-folder"},
                     {"image_fit", f.data.fit},
                     {"test_fraction", f.data.folder.test_fraction},
                     {"split_seed", f.data.folder.split_seed}};
    f.o.validate();
  } else {
    f.o.data_info = {{"dataset", f.data.dataset}};  // predict / eval / serve name the classes
  }
  auto& train_set = *data.train;
  const auto* test_set = data.test && data.test->size() > 0 ? &*data.test : nullptr;
  auto r = train::train(f.o, train_set, test_set, std::cout, group);
  if (group && group->rank() != 0) return 0;  // rank 0 reports
  report_training(f, r);
  return 0;
}

}  // namespace

Subcommand add_train(CLI::App& root) {
  auto f = std::make_shared<TrainFlags>();
  auto* app =
      root.add_subcommand("train", "Train a CapsNet on MNIST or Fashion-MNIST (checkpoint + metrics.jsonl in --out)");
  add_train_flags(*app, *f);
  return {app, [f, app]() {
            apply_train_flags(*f, *app);
            return run_training_command(f->loop, f->o.loop.out_dir, f->o.loop.batch_size,
                                        [f](auto group) { return run_train(*f, std::move(group)); });
          }};
}

}  // namespace capsnet::apps::cli
