#pragma once
// Multi-process data-parallel training on PyTorch's c10d: environment (torchrun variables), the
// process group (Gloo on CPU), bucketed gradient averaging, parameter broadcast, and a test-only
// fault injector. Everything that touches c10d's C++ API (which moves between LibTorch releases)
// lives in distributed.cpp; this header exposes no c10d type.

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace capsnet::train {

/// A collective or the rendezvous failed: a peer exited, a connection dropped, or the timeout
/// passed. what() is one line naming this rank and the operation.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Where this process sits in a job, as torchrun describes it in the environment:
/// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
struct DistributedEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  /// True when there is more than one process (WORLD_SIZE > 1).
  bool active() const { return world_size > 1; }
};

/// Parses the torchrun variables through `lookup` (returns nullptr for an unset variable).
/// WORLD_SIZE unset or 1 means one process (the other variables are then ignored). With
/// WORLD_SIZE > 1, RANK and MASTER_PORT are required, MASTER_ADDR defaults to 127.0.0.1 and
/// LOCAL_RANK to RANK. Throws std::invalid_argument naming the variable and its bad value.
DistributedEnv parse_distributed_env(const std::function<const char*(const char*)>& lookup);

/// Options of the process group.
struct ProcessGroupOptions {
  /// "gloo" (CPU tensors). Another backend (e.g. NCCL for CUDA tensors) is added in one place,
  /// ProcessGroup::create in distributed.cpp.
  TORCH_ARG(std::string, backend) = "gloo";
  /// Seconds a rendezvous or a collective may wait for its peers before failing.
  TORCH_ARG(double, timeout_seconds) = 300;
  /// Network interface Gloo binds to on a multi-host job ("" = the address this host's name
  /// resolves to; loopback jobs use 127.0.0.1). The capsnet command passes GLOO_SOCKET_IFNAME.
  TORCH_ARG(std::string, interface) = "";
  /// Called by the training loop before every step with (rank, step); empty = nothing. The capsnet
  /// command's test-only fault injector plugs in here.
  TORCH_ARG(std::function<void(int, int64_t)>, before_step) = nullptr;
};

/// A connected group of `world_size` processes (c10d TCPStore rendezvous at MASTER_ADDR:MASTER_PORT,
/// rank 0 hosting the store, then a c10d process group of the chosen backend).
class ProcessGroup {
 public:
  /// Connects; blocks until every rank has joined or the timeout passes (DistributedError).
  /// Throws std::invalid_argument for an unknown backend or a one-process env.
  static std::shared_ptr<ProcessGroup> create(const DistributedEnv& env, const ProcessGroupOptions& options = {});
  ~ProcessGroup();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  /// Runs the before_step hook of the options (if any) for this rank.
  void before_step(int64_t step) const {
    if (before_step_) before_step_(rank_, step);
  }

  /// In-place elementwise sum over all ranks of each tensor (contiguous CPU tensors, same shapes
  /// and dtypes on every rank). Throws DistributedError when a peer fails.
  void allreduce_sum(std::vector<torch::Tensor>& tensors);
  /// In-place copy of rank `root`'s tensors to every rank. Throws DistributedError when a peer fails.
  void broadcast(std::vector<torch::Tensor>& tensors, int root = 0);

  struct Impl;

 private:
  ProcessGroup(int rank, int world_size, std::unique_ptr<Impl> impl);
  int rank_, world_size_;
  std::unique_ptr<Impl> impl_;
  std::function<void(int, int64_t)> before_step_;
};

/// Options of GradientReducer.
struct GradientReducerOptions {
  /// Target size of one flattened all-reduce, in bytes. A parameter larger than this is its own
  /// bucket. Fewer, larger buckets mean fewer collective calls (each with a latency floor).
  TORCH_ARG(int64_t, bucket_bytes) = 4 << 20;
};

/// Averages the gradients of `parameters` over the ranks of a group, g <- (1/W) sum_r g_r:
/// gradients are copied into flat per-bucket buffers (parameters in registration order, grouped
/// by dtype up to bucket_bytes), each buffer is all-reduced once, then copied back. A parameter
/// without a gradient on this rank contributes zeros and receives the average.
class GradientReducer {
 public:
  GradientReducer(std::shared_ptr<ProcessGroup> group, std::vector<torch::Tensor> parameters,
                  const GradientReducerOptions& options = {});
  /// All-reduces and averages every parameter's .grad() in place.
  void average();
  /// Number of buckets (all-reduce calls per step).
  int64_t bucket_count() const { return static_cast<int64_t>(buckets_.size()); }
  /// Parameter indices of each bucket.
  std::vector<std::vector<int64_t>> bucket_members() const;

 private:
  struct Bucket {
    std::vector<int64_t> members;  // indices into parameters_
    torch::Tensor flat;            // [sum of numel], the dtype of its members
  };
  std::shared_ptr<ProcessGroup> group_;
  std::vector<torch::Tensor> parameters_;
  std::vector<Bucket> buckets_;
};

/// Copies rank `root`'s values of `parameters` to every rank (in place, without recording autograd).
void broadcast_parameters(ProcessGroup& group, const std::vector<torch::Tensor>& parameters, int root = 0);

/// The rows [begin, end) of a global batch of `batch` examples that `rank` of `world_size` takes:
/// contiguous, in rank order, sizes differing by at most one.
std::pair<int64_t, int64_t> rank_slice(int64_t batch, int rank, int world_size);

}  // namespace capsnet::train
