#include "apps/cli/loop_flags.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include "capsnet/train/distributed.h"
#include "apps/launch.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
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
    throw std::invalid_argument(
        fmt::format("--nproc {}: more processes than the {} cores of this machine", nproc, cores));
  constexpr double kPerRank = 0.6e9;
  if (auto avail = available_memory_bytes(); avail && nproc * kPerRank > *avail)
    throw std::invalid_argument(
        fmt::format("--nproc {} needs about {:.1f} GB of memory ({:.1f} GB per process) but "
                    "{:.1f} GB is available",
                    nproc, nproc * kPerRank / 1e9, kPerRank / 1e9, *avail / 1e9));
}

}  // namespace

void add_loop_flags(CLI::App& app, LoopFlags& f) {
  app.add_option("--resume", f.resume, "Continue exactly from this checkpoint (same options as the run that wrote it)")
      ->check(CLI::ExistingFile);
  add_overwrite_flag(app, f.overwrite);
  app.add_flag("--no-progress", f.no_progress, "No progress bars");
  add_threads_flag(app, f.threads);
  app.add_option("--nproc", f.nproc,
                 "Data-parallel processes on this machine (c10d/Gloo over 127.0.0.1; --threads is split among "
                 "them). Ranks can also be started by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT")
      ->capture_default_str();
  app.add_option("--dist-timeout", f.dist_timeout, "Seconds a rank waits for its peers before failing")
      ->capture_default_str();
}

void add_run_flags(CLI::App& app, train::LoopOptions& loop, const RunFlagsHelp& help) {
  app.add_option("--out", loop.out_dir, "Output directory")->capture_default_str();
  app.add_option("--steps", loop.max_steps, help.steps)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", loop.batch_size, "Training batch size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", loop.lr, help.lr)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seed", loop.seed, help.seed)->capture_default_str();
  app.add_option("--log-every", loop.log_every, "Steps between metrics records")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--checkpoint-every", loop.checkpoint_every, "Steps between checkpoints (0 = at the end)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

int run_training_command(const LoopFlags& f, const std::string& out_dir, int64_t batch_size,
                         const std::function<int(std::shared_ptr<train::ProcessGroup>)>& body) {
  if (f.threads > 0) set_threads(f.threads);
  const auto env = distributed_env_from_environment();
  // Ranks started by a launcher skip the check: rank 0 may already have begun writing.
  if (!env.active()) check_run_dir(out_dir, f.resume, f.overwrite, /*can_resume=*/true);
  if (f.nproc > 1) {
    if (env.active())
      throw std::invalid_argument(
          fmt::format("--nproc {} cannot be combined with WORLD_SIZE={} in the environment: use one or the other",
                      f.nproc, env.world_size));
    if (batch_size < f.nproc)
      throw std::invalid_argument(
          fmt::format("--nproc {} needs --batch-size >= {} (each process takes a slice of "
                      "every batch), got {}",
                      f.nproc, f.nproc, batch_size));
    check_nproc_resources(f.nproc);
    apps::LaunchOptions launch;
    launch.nproc = f.nproc;
    const int total = f.threads > 0 ? f.threads : static_cast<int>(std::thread::hardware_concurrency());
    launch.threads_per_rank = std::max(1, total / f.nproc);
    std::cout << fmt::format("launching {} processes on 127.0.0.1, {} intra-op thread(s) each\n", f.nproc,
                             launch.threads_per_rank)
              << std::flush;
    return apps::launch_local(apps::remove_flags(apps::self_command_line(), {"--nproc", "--threads"}), launch,
                               std::cerr);
  }
  std::shared_ptr<train::ProcessGroup> group;
  if (env.active())
    group = train::ProcessGroup::create(env, process_group_options_from_environment(f.dist_timeout));
  return body(group);
}

}  // namespace capsnet::apps::cli
