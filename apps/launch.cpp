#include "apps/launch.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace capsnet::apps {
namespace {

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("ended with wait status {}", status);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

bool failed(int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }

}  // namespace

std::vector<std::string> self_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  if (!in) throw std::runtime_error("cannot read /proc/self/cmdline");
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  size_t start = 0;
  for (size_t i = 0; i < raw.size(); ++i)
    if (raw[i] == '\0') {
      args.push_back(raw.substr(start, i - start));
      start = i + 1;
    }
  return args;
}

std::vector<std::string> remove_flags(const std::vector<std::string>& args, const std::vector<std::string>& flags) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    bool drop = false;
    for (const auto& f : flags) {
      if (args[i] == f) {
        drop = true;
        ++i;  // and its value
        break;
      }
      if (args[i].rfind(f + "=", 0) == 0) {
        drop = true;
        break;
      }
    }
    if (!drop) out.push_back(args[i]);
  }
  return out;
}

int free_tcp_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(fmt::format("socket(): {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("cannot find a free TCP port on 127.0.0.1: " + why);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

int launch_local(const std::vector<std::string>& argv, const LaunchOptions& options, std::ostream& err) {
  if (options.nproc < 1) throw std::invalid_argument(fmt::format("--nproc must be >= 1, got {}", options.nproc));
  if (options.threads_per_rank < 1)
    throw std::invalid_argument(fmt::format("threads per rank must be >= 1, got {}", options.threads_per_rank));
  if (argv.empty()) throw std::invalid_argument("launch_local: empty command line");
  const int port = options.master_port > 0 ? options.master_port : free_tcp_port();

  // Everything the child needs is built before fork(): between fork and exec only
  // async-signal-safe calls are allowed (this process may already run torch's thread pool).
  std::vector<std::string> base_env;
  const std::vector<std::string> ours = {"RANK=", "LOCAL_RANK=", "WORLD_SIZE=", "MASTER_ADDR=", "MASTER_PORT=",
                                         "CAPSNET_THREADS="};
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    bool replaced = false;
    for (const auto& o : ours) replaced = replaced || entry.rfind(o, 0) == 0;
    if (!replaced) base_env.push_back(entry);
  }
  std::vector<char*> child_argv;
  for (const auto& a : argv) child_argv.push_back(const_cast<char*>(a.c_str()));
  child_argv.push_back(nullptr);

  std::map<pid_t, int> rank_of;
  std::vector<pid_t> pids;
  auto stop_all = [&](int sig) {
    for (auto& [pid, rank] : rank_of) ::kill(pid, sig);
  };
  for (int rank = 0; rank < options.nproc; ++rank) {
    std::vector<std::string> env = base_env;
    env.push_back(fmt::format("RANK={}", rank));
    env.push_back(fmt::format("LOCAL_RANK={}", rank));
    env.push_back(fmt::format("WORLD_SIZE={}", options.nproc));
    env.push_back("MASTER_ADDR=" + options.master_addr);
    env.push_back(fmt::format("MASTER_PORT={}", port));
    env.push_back(fmt::format("CAPSNET_THREADS={}", options.threads_per_rank));
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const bool quiet = options.quiet_other_ranks && rank > 0;

    std::fflush(nullptr);
    err.flush();
    const pid_t pid = ::fork();
    if (pid < 0) {
      const std::string why = std::strerror(errno);
      stop_all(SIGKILL);
      for (auto& [p, r] : rank_of) ::waitpid(p, nullptr, 0);
      throw std::runtime_error(fmt::format("cannot start rank {}: fork(): {}", rank, why));
    }
    if (pid == 0) {
      if (quiet) {
        const int devnull = ::open("/dev/null", O_WRONLY);
        if (devnull >= 0) ::dup2(devnull, STDOUT_FILENO);
      }
      ::execve("/proc/self/exe", child_argv.data(), envp.data());
      const char msg[] = "capsnet: launcher: execve(/proc/self/exe) failed\n";
      (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
      ::_exit(127);
    }
    rank_of[pid] = rank;
    pids.push_back(pid);
  }

  int result = 0;
  bool stopping = false;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (!rank_of.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) break;  // no children left
    if (pid <= 0) {
      if (stopping && std::chrono::steady_clock::now() > deadline) {
        stop_all(SIGKILL);
        deadline = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    auto it = rank_of.find(pid);
    if (it == rank_of.end()) continue;  // not one of ours
    const int rank = it->second;
    rank_of.erase(it);
    if (failed(status) && !stopping) {
      stopping = true;
      result = exit_code(status);
      err << fmt::format("capsnet: rank {} of {} (pid {}) {}; stopping the other {} rank(s)\n", rank, options.nproc,
                         pid, describe(status), rank_of.size())
          << std::flush;
      stop_all(SIGTERM);
      deadline = std::chrono::steady_clock::now() +
                 std::chrono::milliseconds(static_cast<int64_t>(options.kill_grace_seconds * 1000));
    }
  }
  return result;
}

train::DistributedEnv distributed_env_from_environment() {
  return train::parse_distributed_env([](const char* name) { return std::getenv(name); });
}

train::ProcessGroupOptions process_group_options_from_environment(double timeout_seconds) {
  auto options = train::ProcessGroupOptions().timeout_seconds(timeout_seconds).before_step(maybe_inject_fault);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) options.interface(ifname);
  return options;
}

void maybe_inject_fault(int rank, int64_t step) {
  const char* spec = std::getenv("CAPSNET_FAULT_EXIT_AT_STEP");
  if (!spec) return;
  const std::string s = spec;
  const auto colon = s.find(':');
  char* end = nullptr;
  long fault_rank = -1;
  long long fault_step = -1;
  bool ok = colon != std::string::npos && colon > 0 && colon + 1 < s.size();
  if (ok) {
    fault_rank = std::strtol(s.substr(0, colon).c_str(), &end, 10);
    ok = *end == '\0' && fault_rank >= 0;
  }
  if (ok) {
    fault_step = std::strtoll(s.substr(colon + 1).c_str(), &end, 10);
    ok = *end == '\0' && fault_step >= 0;
  }
  if (!ok)
    throw std::invalid_argument(
        fmt::format("environment variable CAPSNET_FAULT_EXIT_AT_STEP='{}' is not <rank>:<step> (test only)", s));
  if (fault_rank == rank && fault_step == step) {
    fmt::print(stderr, "rank {}: CAPSNET_FAULT_EXIT_AT_STEP: exiting with status 17 at step {} (injected fault)\n",
               rank, step);
    std::fflush(stderr);
    std::_Exit(17);
  }
}

}  // namespace capsnet::apps
