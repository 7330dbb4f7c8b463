#pragma once
// One-machine launcher for data-parallel training: starts N copies of this executable with the
// torchrun variables set, waits, and stops the others when one fails.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "capsnet/train/distributed.h"

namespace capsnet::apps {

/// Options of launch_local.
struct LaunchOptions {
  int nproc = 2;                         // processes (ranks 0..nproc-1)
  int threads_per_rank = 1;              // CAPSNET_THREADS of each rank
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                   // 0: pick a free TCP port
  bool quiet_other_ranks = true;         // stdout of ranks > 0 to /dev/null (stderr is kept)
  double kill_grace_seconds = 5;         // SIGTERM -> SIGKILL delay when stopping the survivors
};

/// Starts `nproc` processes running `argv` (argv[0] is ignored: /proc/self/exe is executed) with
/// RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and CAPSNET_THREADS set, and waits.
/// Returns 0 when all exit 0. When one exits non-zero or is killed by a signal, the others are
/// stopped, a line naming the rank and its status goes to `err`, and the return is that rank's
/// exit status (or 128 + signal). Throws std::invalid_argument for nproc < 1, std::runtime_error
/// when a process cannot be started.
int launch_local(const std::vector<std::string>& argv, const LaunchOptions& options, std::ostream& err);

/// This process's command line, read from /proc/self/cmdline.
std::vector<std::string> self_command_line();

/// `args` without the options named in `flags`, in both "--flag value" and "--flag=value" forms.
std::vector<std::string> remove_flags(const std::vector<std::string>& args, const std::vector<std::string>& flags);

/// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back, close).
int free_tcp_port();

/// train::parse_distributed_env over the process environment (the torchrun variables).
train::DistributedEnv distributed_env_from_environment();

/// Process-group options from the environment: GLOO_SOCKET_IFNAME as the interface, and the
/// test-only fault injector (maybe_inject_fault) as the before-step hook.
train::ProcessGroupOptions process_group_options_from_environment(double timeout_seconds);

/// TEST-ONLY fault injection. If CAPSNET_FAULT_EXIT_AT_STEP is "<rank>:<step>" and matches, the
/// process exits at once with status 17 (std::_Exit: no cleanup, like a crash). Unset: no effect.
/// A malformed value throws std::invalid_argument naming the variable.
void maybe_inject_fault(int rank, int64_t step);

}  // namespace capsnet::apps
