#pragma once
// The flags every training command shares, and how such a command runs: one process, --nproc
// processes launched on this machine, or one rank of a job started by torchrun-style variables.
// The loop behind them is train::run (capsnet/train/loop.h).

#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <string>

#include "capsnet/train/loop.h"
#include "apps/cli/commands.h"

namespace capsnet::train {
class ProcessGroup;
}

namespace capsnet::apps::cli {

struct LoopFlags {
  std::string resume;  // checkpoint to continue from exactly
  bool overwrite = false;
  bool no_progress = false;
  int threads = 0;
  int nproc = 1;              // data-parallel processes started by this command (docs/distributed.md)
  double dist_timeout = 300;  // seconds a rank waits for its peers
};

/// What the image-to-image experiments (capsnet segcaps, capsnet capspix2pix) share beyond the loop's flags;
/// each registers them with its own help text.
struct ImageExperimentFlags {
  std::string precision;  // --precision, parsed into the loop options
  uint64_t test_seed = 1001;
  int64_t figure_rows = 8;
  double max_minutes = 0;
  bool composite_routing = false;
  DataFlags data;
  LoopFlags loop;
};

/// Registers --resume, --overwrite, --no-progress, --threads, --nproc and --dist-timeout.
void add_loop_flags(CLI::App& app, LoopFlags& flags);

/// How a step-counted experiment describes the run flags that differ in meaning between them.
struct RunFlagsHelp {
  std::string steps = "Optimizer steps";
  std::string lr = "Adam learning rate";
  std::string seed = "Seed of the initialisation and the example order";
};

/// Registers the run's own options on `loop`: --out, --steps, --batch-size, --lr, --seed, --log-every and
/// --checkpoint-every (0 = at the end). Used by the experiments that count steps (em, multimnist, segcaps,
/// capspix2pix); `capsnet train` counts epochs and registers its own.
void add_run_flags(CLI::App& app, train::LoopOptions& loop, const RunFlagsHelp& help);

/// Runs a training command: sets the threads, refuses an --out that holds another run (unless
/// resuming or --overwrite), then either launches flags.nproc copies of this command line (returns
/// their exit status), or joins the process group described by the environment, or runs alone;
/// `body(group)` does the work (group is null in one process; only rank 0 should write results).
int run_training_command(const LoopFlags& flags, const std::string& out_dir, int64_t batch_size,
                         const std::function<int(std::shared_ptr<train::ProcessGroup>)>& body);

}  // namespace capsnet::apps::cli
