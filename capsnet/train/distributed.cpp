#include "capsnet/train/distributed.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>

// c10d ships its Gloo process group behind USE_C10D_GLOO; the symbols are in libtorch_cpu when
// LibTorch was built with distributed support (Debian's is, pip wheels are). Gloo's own headers
// come from libgloo-dev (scripts/setup.sh). Without them the library still builds and
// ProcessGroup::create says what is missing.
#if __has_include(<torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>) && __has_include(<gloo/context.h>)
#define CAPSNET_HAVE_GLOO 1
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#else
#define CAPSNET_HAVE_GLOO 0
#endif

namespace capsnet::train {
namespace {

std::string first_line(std::string s) {
  if (auto pos = s.find('\n'); pos != std::string::npos) s.resize(pos);
  return s;
}

int parse_int(const char* name, const char* text, int lo, int hi) {
  const std::string value = text;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno != 0 || v < lo || v > hi)
    throw std::invalid_argument(
        fmt::format("environment variable {}='{}' is not an integer in [{}, {}]", name, value, lo, hi));
  return static_cast<int>(v);
}

}  // namespace

DistributedEnv parse_distributed_env(const std::function<const char*(const char*)>& lookup) {
  DistributedEnv env;
  const char* world = lookup("WORLD_SIZE");
  if (!world) return env;
  env.world_size = parse_int("WORLD_SIZE", world, 1, 1 << 16);
  if (!env.active()) return env;
  const char* rank = lookup("RANK");
  if (!rank)
    throw std::invalid_argument(
        fmt::format("environment variable RANK is not set but WORLD_SIZE={} (set RANK in [0, {}))", env.world_size,
                    env.world_size));
  env.rank = parse_int("RANK", rank, 0, env.world_size - 1);
  const char* local = lookup("LOCAL_RANK");
  env.local_rank = local ? parse_int("LOCAL_RANK", local, 0, env.world_size - 1) : env.rank;
  if (const char* addr = lookup("MASTER_ADDR")) {
    if (std::string(addr).empty()) throw std::invalid_argument("environment variable MASTER_ADDR is empty");
    env.master_addr = addr;
  }
  const char* port = lookup("MASTER_PORT");
  if (!port)
    throw std::invalid_argument(
        fmt::format("environment variable MASTER_PORT is not set but WORLD_SIZE={} (rank 0 listens on it)",
                    env.world_size));
  env.master_port = parse_int("MASTER_PORT", port, 1, 65535);
  return env;
}

#if CAPSNET_HAVE_GLOO
struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::chrono::milliseconds timeout;
};
#else
struct ProcessGroup::Impl {};
#endif

ProcessGroup::ProcessGroup(int rank, int world_size, std::unique_ptr<Impl> impl)
    : rank_(rank), world_size_(world_size), impl_(std::move(impl)) {}

ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(const DistributedEnv& env, const ProcessGroupOptions& options) {
  if (!env.active())
    throw std::invalid_argument(fmt::format("a process group needs WORLD_SIZE > 1, got {}", env.world_size));
  if (!(options.timeout_seconds() > 0))
    throw std::invalid_argument(fmt::format("distributed timeout must be positive, got {} s", options.timeout_seconds()));
  // The one place a backend is chosen: an NCCL (CUDA) branch would construct c10d::ProcessGroupNCCL
  // here with the same store; the trainer only sees allreduce_sum / broadcast.
  if (options.backend() != "gloo")
    throw std::invalid_argument(fmt::format("distributed backend '{}' is not available (this build has: gloo)",
                                            options.backend()));
#if CAPSNET_HAVE_GLOO
  auto impl = std::make_unique<Impl>();
  impl->timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds() * 1000));
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<std::uint16_t>(env.master_port);
    store_options.isServer = env.rank == 0;
    store_options.numWorkers = static_cast<std::size_t>(env.world_size);
    store_options.waitWorkers = true;
    store_options.timeout = impl->timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);

    auto gloo_options = c10d::ProcessGroupGloo::Options::create(impl->timeout);
    // Loopback jobs bind to 127.0.0.1 (no name resolution); a multi-host job uses the interface in
    // options.interface() if given, else the address this host's name resolves to.
    if (!options.interface().empty())
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(options.interface()));
    else if (env.master_addr == "127.0.0.1" || env.master_addr == "localhost")
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, env.rank, env.world_size, gloo_options);
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format("rank {}: could not join the process group at {}:{} (world size {}, "
                                       "timeout {} s): {}",
                                       env.rank, env.master_addr, env.master_port, env.world_size,
                                       options.timeout_seconds(), first_line(e.what())));
  }
  auto group = std::shared_ptr<ProcessGroup>(new ProcessGroup(env.rank, env.world_size, std::move(impl)));
  group->before_step_ = options.before_step();
  return group;
#else
  throw std::invalid_argument(
      "this capsnet was built without c10d Gloo headers (install libgloo-dev and rebuild) so multi-process "
      "training is unavailable");
#endif
}

void ProcessGroup::allreduce_sum(std::vector<torch::Tensor>& tensors) {
#if CAPSNET_HAVE_GLOO
  try {
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = impl_->timeout;
    impl_->group->allreduce(tensors, opts)->wait();
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format("rank {}: all-reduce failed (a peer process exited, lost its connection or "
                                       "timed out): {}",
                                       rank_, first_line(e.what())));
  }
#else
  (void)tensors;
#endif
}

void ProcessGroup::broadcast(std::vector<torch::Tensor>& tensors, int root) {
  if (root < 0 || root >= world_size_)
    throw std::invalid_argument(fmt::format("broadcast root {} is not a rank in [0, {})", root, world_size_));
#if CAPSNET_HAVE_GLOO
  try {
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = impl_->timeout;
    impl_->group->broadcast(tensors, opts)->wait();
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format("rank {}: broadcast from rank {} failed (a peer process exited, lost its "
                                       "connection or timed out): {}",
                                       rank_, root, first_line(e.what())));
  }
#else
  (void)tensors;
#endif
}

GradientReducer::GradientReducer(std::shared_ptr<ProcessGroup> group, std::vector<torch::Tensor> parameters,
                                 const GradientReducerOptions& options)
    : group_(std::move(group)), parameters_(std::move(parameters)) {
  if (!group_) throw std::invalid_argument("GradientReducer: group must not be null");
  if (options.bucket_bytes() <= 0)
    throw std::invalid_argument(fmt::format("bucket_bytes must be positive, got {}", options.bucket_bytes()));
  // Buckets fill in registration order and close when full or when the dtype changes; every rank
  // builds the same layout from the same model, so the flat buffers line up element for element.
  std::vector<std::vector<int64_t>> groups;
  int64_t open_bytes = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(parameters_.size()); ++i) {
    const auto& p = parameters_[i];
    if (!p.device().is_cpu())
      throw std::invalid_argument(fmt::format("GradientReducer: parameter {} is on {}; the gloo backend reduces "
                                              "CPU tensors",
                                              i, p.device().str()));
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    const bool fits = !groups.empty() && parameters_[groups.back().front()].scalar_type() == p.scalar_type() &&
                      open_bytes + bytes <= options.bucket_bytes();
    if (!fits) {
      groups.emplace_back();
      open_bytes = 0;
    }
    groups.back().push_back(i);
    open_bytes += bytes;
  }
  for (auto& members : groups) {
    int64_t numel = 0;
    for (auto i : members) numel += parameters_[i].numel();
    buckets_.push_back({members, torch::empty({numel}, parameters_[members.front()].options().requires_grad(false))});
  }
}

std::vector<std::vector<int64_t>> GradientReducer::bucket_members() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) out.push_back(b.members);
  return out;
}

void GradientReducer::average() {
  torch::NoGradGuard no_grad;
  const double inv_world = 1.0 / group_->world_size();
  for (auto& bucket : buckets_) {
    int64_t offset = 0;
    for (auto i : bucket.members) {
      const auto& p = parameters_[i];
      auto slot = bucket.flat.narrow(0, offset, p.numel());  // [numel(p)] view into the bucket
      if (p.grad().defined())
        slot.copy_(p.grad().reshape({-1}));
      else
        slot.zero_();
      offset += p.numel();
    }
    std::vector<torch::Tensor> one{bucket.flat};
    group_->allreduce_sum(one);
    bucket.flat.mul_(inv_world);
    offset = 0;
    for (auto i : bucket.members) {
      auto& p = parameters_[i];
      auto slot = bucket.flat.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined())
        p.mutable_grad().copy_(slot);
      else
        p.mutable_grad() = slot.clone();
      offset += p.numel();
    }
  }
}

void broadcast_parameters(ProcessGroup& group, const std::vector<torch::Tensor>& parameters, int root) {
  torch::NoGradGuard no_grad;
  // One flat buffer per dtype: a single broadcast call each instead of one per parameter.
  std::vector<c10::ScalarType> dtypes;
  for (const auto& p : parameters)
    if (std::find(dtypes.begin(), dtypes.end(), p.scalar_type()) == dtypes.end()) dtypes.push_back(p.scalar_type());
  for (auto dtype : dtypes) {
    std::vector<torch::Tensor> members;
    for (const auto& p : parameters)
      if (p.scalar_type() == dtype) members.push_back(p.reshape({-1}));
    std::vector<torch::Tensor> flat{torch::cat(members).contiguous()};
    group.broadcast(flat, root);
    int64_t offset = 0;
    for (const auto& p : parameters) {
      if (p.scalar_type() != dtype) continue;
      const_cast<torch::Tensor&>(p).copy_(flat[0].narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

std::pair<int64_t, int64_t> rank_slice(int64_t batch, int rank, int world_size) {
  if (world_size <= 0 || rank < 0 || rank >= world_size)
    throw std::invalid_argument(fmt::format("rank_slice: rank {} is not in [0, world size {})", rank, world_size));
  if (batch < 0) throw std::invalid_argument(fmt::format("rank_slice: batch must be >= 0, got {}", batch));
  return {batch * rank / world_size, batch * (rank + 1) / world_size};
}

}  // namespace capsnet::train
