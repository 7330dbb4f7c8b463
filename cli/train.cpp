#include <fmt/format.h>

#include <fstream>
#include <iostream>
#include <optional>
#include <memory>
#include <thread>

#include "capsnet/data/mnist.h"
#include "capsnet/train/distributed.h"
#include "capsnet/train/launch.h"
#include "capsnet/train/runtime.h"
#include "capsnet/train/trainer.h"
#include "cli/commands.h"

namespace capsnet::cli {
namespace {

// Bytes this process may still use: the smaller of MemAvailable and the cgroup's (v2) headroom.
std::optional<double> available_memory_bytes() {
  std::optional<double> best;
  auto take = [&](double v) { best = best ? std::min(*best, v) : v; };
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    double kb = 0;
    std::string unit;
    meminfo >> kb >> unit;
    if (key == "MemAvailable:") take(kb * 1024);
  }
  std::ifstream max("/sys/fs/cgroup/memory.max"), current("/sys/fs/cgroup/memory.current");
  std::string limit;
  double used = 0;
  if (max >> limit && limit != "max" && current >> used) take(std::stod(limit) - used);
  return best;
}

// Every rank holds the data set, a model, Adam's state and a batch's activations (~0.6 GB for the
// paper's model at batch 100, measured by `capsnet bench`): refuse what would be OOM-killed.
void check_nproc_resources(int nproc) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (static_cast<unsigned>(nproc) > cores)
    throw std::invalid_argument(fmt::format("--nproc {}: more processes than the {} cores of this machine", nproc,
                                            cores));
  constexpr double kPerRank = 0.6e9;
  if (auto avail = available_memory_bytes(); avail && nproc * kPerRank > *avail)
    throw std::invalid_argument(fmt::format("--nproc {} needs about {:.1f} GB of memory ({:.1f} GB per process) but "
                                            "{:.1f} GB is available",
                                            nproc, nproc * kPerRank / 1e9, kPerRank / 1e9, *avail / 1e9));
}

}  // namespace

Subcommand add_train(CLI::App& root) {
  struct Flags {
    train::TrainOptions o;
    DataFlags data;
    int64_t train_limit = 0, test_limit = 0;
    bool no_reconstruction = false, stop_routing_grad = false, no_eval = false, no_progress = false,
         composite_routing = false, overwrite = false;
    int threads = 0;
    int nproc = 1;              // data-parallel processes started by this command (docs/distributed.md)
    double dist_timeout = 300;  // seconds a rank waits for its peers
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand("train", "Train a CapsNet on MNIST (checkpoint + metrics.jsonl in --out)");
  add_data_flags(*app, f->data);
  app->add_option("--out", f->o.out_dir, "Output directory (checkpoint.pt, metrics.jsonl)")->capture_default_str();
  app->add_option("--epochs", f->o.epochs, "Epochs")->check(CLI::NonNegativeNumber)->capture_default_str();
  app->add_option("--steps", f->o.max_steps, "Total optimizer steps (overrides --epochs when > 0)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--batch-size", f->o.batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--lr", f->o.lr, "Adam learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--lr-decay", f->o.lr_decay, "Learning-rate factor per epoch, in (0, 1]")
      ->check(CLI::Range(1e-9, 1.0))
      ->capture_default_str();
  app->add_option("--routing-iters", f->o.model.routing_iterations, "Dynamic routing iterations r")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app->add_flag("--stop-routing-grad", f->stop_routing_grad,
                "Treat coupling coefficients c_ij as constants in backprop (default: full gradient)");
  app->add_flag("--composite-routing", f->composite_routing,
                "Route with plain tensor ops instead of the fused operator (same math; slower, more memory)");
  add_precision_flag(*app, f->o.precision);
  app->add_flag("--no-reconstruction", f->no_reconstruction, "No decoder and no reconstruction loss");
  app->add_flag("--stn", f->o.model.stn, "Spatial transformer in front of the CapsNet (identity at init)");
  app->add_option("--max-shift", f->o.max_shift, "Random shift augmentation, pixels")
      ->check(CLI::Range(0, 27))
      ->capture_default_str();
  app->add_option("--seed", f->o.seed, "Random seed (init, data order, shifts)")->capture_default_str();
  app->add_option("--train-limit", f->train_limit, "Use only the first N training images (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--test-limit", f->test_limit, "Evaluate on the first N test images (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--checkpoint-every", f->o.checkpoint_every, "Steps between checkpoints (also at epoch ends)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--log-every", f->o.log_every, "Steps between metrics records")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--resume", f->o.resume, "Continue exactly from this checkpoint")->check(CLI::ExistingFile);
  add_overwrite_flag(*app, f->overwrite);
  app->add_flag("--no-eval", f->no_eval, "Skip the test-set evaluation at epoch ends");
  app->add_flag("--no-progress", f->no_progress, "No progress bar");
  add_threads_flag(*app, f->threads);
  app->add_option("--nproc", f->nproc,
                  "Data-parallel processes on this machine (c10d/Gloo over 127.0.0.1; --threads is split among "
                  "them). Ranks can also be started by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app->add_option("--dist-timeout", f->dist_timeout, "Seconds a rank waits for its peers before failing")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  return {app, [f]() {
            if (f->threads > 0) set_threads(f->threads);
            f->o.model.reconstruction = !f->no_reconstruction;
            f->o.model.grad_through_routing = !f->stop_routing_grad;
            f->o.evaluate_each_epoch = !f->no_eval;
            f->o.fused_routing = !f->composite_routing;
            f->o.progress = !f->no_progress;
            f->o.validate();  // before loading 50 MB of data
            const auto env = train::distributed_env_from_environment();
            // Ranks started by a launcher skip the check: rank 0 may already have begun writing.
            if (!env.active()) check_run_dir(f->o.out_dir, !f->o.resume.empty(), f->overwrite, /*can_resume=*/true);
            if (f->nproc > 1) {
              if (env.active())
                throw std::invalid_argument(fmt::format(
                    "--nproc {} cannot be combined with WORLD_SIZE={} in the environment: use one or the other",
                    f->nproc, env.world_size));
              if (f->o.batch_size < f->nproc)
                throw std::invalid_argument(fmt::format("--nproc {} needs --batch-size >= {} (each process takes a "
                                                        "slice of every batch), got {}",
                                                        f->nproc, f->nproc, f->o.batch_size));
              check_nproc_resources(f->nproc);
              train::LaunchOptions launch;
              launch.nproc = f->nproc;
              const int total = f->threads > 0 ? f->threads : static_cast<int>(std::thread::hardware_concurrency());
              launch.threads_per_rank = std::max(1, total / f->nproc);
              std::cout << fmt::format("launching {} processes on 127.0.0.1, {} intra-op thread(s) each\n", f->nproc,
                                       launch.threads_per_rank)
                        << std::flush;
              return train::launch_local(train::remove_flags(train::self_command_line(), {"--nproc", "--threads"}),
                                         launch, std::cerr);
            }
            std::shared_ptr<train::ProcessGroup> group;
            if (env.active())
              group = train::ProcessGroup::create(env, train::ProcessGroupOptions().timeout_seconds(f->dist_timeout));
            auto train_set = data::take(data::load_mnist(f->data.resolved(), data::Split::kTrain), f->train_limit);
            std::optional<data::ImageSet> test_set;
            if (!f->no_eval) test_set = data::take(data::load_mnist(f->data.resolved(), data::Split::kTest), f->test_limit);
            auto r = train::train(f->o, train_set, test_set ? &*test_set : nullptr, std::cout, group);
            if (group && group->rank() != 0) return 0;  // rank 0 reports
            std::cout << fmt::format("trained steps {}..{} in {:.1f} s ({:.1f} img/s)\n", r.start_step, r.end_step,
                                     r.seconds, r.images_per_second);
            if (r.test)
              std::cout << fmt::format("test accuracy: {:.2f}% (error {:.2f}%) on {} images\n", 100 * r.test->accuracy,
                                       100 * (1 - r.test->accuracy), r.test->examples);
            std::cout << fmt::format("checkpoint: {}\nmetrics: {}\n", r.checkpoint,
                                     train::metrics_path(f->o.out_dir));
            return 0;
          }};
}

}  // namespace capsnet::cli
