// CUDA kernels of the fused routing operators, registered for the CUDA dispatch key (schemas in
// ../library.cpp; device code in routing_kernels.cuh). float32 / float64, and float16 / bfloat16 inputs
// with float32 accumulation and a float32 routing state s_all. Every launch goes on the current stream of
// the inputs' device; nothing here synchronises with the host.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <tuple>

#include "capsnet/ops/cuda/routing_fast_kernels.cuh"
#include "capsnet/ops/cuda/routing_kernels.cuh"
#include "capsnet/ops/routing.h"
#include "capsnet/ops/routing_checks.h"

namespace capsnet::ops::cuda {
namespace {

constexpr const char* kFusedOp = "capsnet::capsule_routing";
constexpr const char* kPredOp = "capsnet::routing_from_predictions";
constexpr int kWarpsPerBlock = 8;
constexpr int kFinishThreads = 256;
constexpr size_t kDefaultSharedBytes = 48 * 1024;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

size_t shared_limit() { return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin; }
int64_t sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Opts the kernel in to more than 48 KB of dynamic shared memory when it needs it.
template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  if (bytes > kDefaultSharedBytes)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Launch shape of a pass over the children: warps per block, examples per block, chunks of children.
struct PassPlan {
  int64_t warps, eb, nchunk, chunk_size;
  size_t smem;
};

// warp_scratch: shared values per warp besides its eb * JD sums (the general kernel's uh, c and gb).
PassPlan plan_pass(const char* op, const RoutingDims& n, bool grad_pass, size_t acc_bytes, int64_t warp_scratch) {
  const size_t limit = shared_limit();
  auto bytes = [&](int64_t warps, int64_t eb) {
    return acc_bytes * static_cast<size_t>(eb * n.JD * (grad_pass ? 2 : 1) + warps * (warp_scratch + eb * n.JD));
  };
  int64_t warps = kWarpsPerBlock, eb = acc_bytes == 8 ? 4 : 8;
  while (bytes(warps, eb) > limit && eb > 1) eb /= 2;
  while (bytes(warps, eb) > limit && warps > 1) warps /= 2;
  TORCH_CHECK(bytes(warps, eb) <= limit, op, ": J * D = ", n.JD, " is too large for the CUDA kernel (",
              bytes(warps, eb), " bytes of shared memory per block, the device has ", limit, ")");
  eb = std::min(eb, n.B);
  const int64_t groups = ceil_div(n.B, eb);
  // About eight blocks per multiprocessor, each chunk with at least one child per warp.
  const int64_t max_chunks = std::max<int64_t>(1, ceil_div(n.I, warps));
  const int64_t nchunk = std::clamp<int64_t>(ceil_div(8 * sm_count(), groups), 1, max_chunks);
  const int64_t chunk_size = std::max<int64_t>(1, ceil_div(n.I, nchunk));
  return {warps, eb, ceil_div(std::max<int64_t>(n.I, 1), chunk_size), chunk_size, bytes(warps, eb)};
}

dim3 pass_grid(const PassPlan& p, const RoutingDims& n) {
  return dim3(static_cast<unsigned>(p.nchunk), static_cast<unsigned>(ceil_div(n.B, p.eb)));
}

// One pass through the general kernel (any sizes; u_hat recomputed by Pred or read).
template <typename T, typename A, typename Pred>
struct GeneralPass {
  Pred pred;
  int64_t warp_scratch(const RoutingDims& n) const { return n.JD + 2 * n.J; }
  void launch(const PassPlan& p, const RoutingDims& n, int64_t t, bool grad_pass, const A* a_state,
              const A* gs_state, int64_t stride, A* parts) const {
    auto kernel = routing_pass_kernel<T, A, Pred>;
    allow_shared(kernel, p.smem);
    kernel<<<pass_grid(p, n), static_cast<unsigned>(p.warps * kWarp), p.smem, at::cuda::getCurrentCUDAStream()>>>(
        pred, n, t, grad_pass, a_state, gs_state, stride, p.chunk_size, p.eb, parts);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// One pass through the fast kernel (routing_fast_kernels.cuh: D = 16, Din = 8, J <= 2 kSlots, float state).
template <typename T, int kSlots>
struct FastPass {
  const T* u;
  const T* w;
  int64_t warp_scratch(const RoutingDims& /*n*/) const { return 0; }
  void launch(const PassPlan& p, const RoutingDims& n, int64_t t, bool grad_pass, const float* a_state,
              const float* gs_state, int64_t stride, float* parts) const {
    auto kernel = fast_pass_kernel<T, kSlots>;
    allow_shared(kernel, p.smem);
    kernel<<<pass_grid(p, n), static_cast<unsigned>(p.warps * kWarp), p.smem, at::cuda::getCurrentCUDAStream()>>>(
        u, w, n, t, grad_pass, a_state, gs_state, stride, p.chunk_size, p.eb, parts);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// Forward: r passes over the children, each followed by the per-example finish. v: [B, J, D] (T),
// s_all: [B, r, J, D] (A).
template <typename T, typename A, typename Pass>
void run_forward(const char* op, const Pass& pass, const RoutingDims& n, at::Tensor& v, at::Tensor& s_all) {
  if (n.B == 0 || n.JD == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto opts = s_all.options();
  const PassPlan p = plan_pass(op, n, false, sizeof(A), pass.warp_scratch(n));
  auto a_run = at::zeros({n.B, n.JD}, opts);
  auto parts = at::empty({n.B, p.nchunk, n.JD}, opts);
  const size_t finish_smem = sizeof(A) * static_cast<size_t>(n.JD + n.J);
  auto finish = forward_finish_kernel<T, A>;
  allow_shared(finish, finish_smem);
  for (int64_t t = 0; t < n.r; ++t) {
    pass.launch(p, n, t, false, a_run.data_ptr<A>(), static_cast<const A*>(nullptr), n.JD, parts.data_ptr<A>());
    finish<<<static_cast<unsigned>(n.B), kFinishThreads, finish_smem, stream>>>(
        n, t, p.nchunk, static_cast<A>(kSquashEps), parts.data_ptr<A>(), a_run.data_ptr<A>(), s_all.data_ptr<A>(),
        v.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Backward phase 1: a_all (A^t) and gs_all (dL/ds^t) for every t used by phase 2.
template <typename T, typename A, typename Pass>
void run_backward_state(const char* op, const Pass& pass, const RoutingDims& n, bool full, const at::Tensor& grad_v,
                        const at::Tensor& s_all, at::Tensor& a_all, at::Tensor& gs_all) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const size_t init_smem = sizeof(A) * static_cast<size_t>(3 * n.J);
  backward_init_kernel<T, A><<<static_cast<unsigned>(n.B), kFinishThreads, init_smem, stream>>>(
      n, static_cast<A>(kSquashEps), s_all.data_ptr<A>(), grad_v.data_ptr<T>(), a_all.data_ptr<A>(),
      gs_all.data_ptr<A>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!full || n.r == 1) return;
  const PassPlan p = plan_pass(op, n, true, sizeof(A), pass.warp_scratch(n));
  auto g_later = at::zeros({n.B, n.JD}, s_all.options());
  auto parts = at::empty({n.B, p.nchunk, n.JD}, s_all.options());
  const int64_t stride = n.r * n.JD;
  for (int64_t t = n.r - 1; t >= 1; --t) {
    pass.launch(p, n, t, true, a_all.data_ptr<A>() + t * n.JD,
                static_cast<const A*>(gs_all.data_ptr<A>() + t * n.JD), stride, parts.data_ptr<A>());
    backward_step_kernel<A><<<static_cast<unsigned>(n.B), kFinishThreads, sizeof(A) * 2 * n.J, stream>>>(
        n, t, p.nchunk, static_cast<A>(kSquashEps), parts.data_ptr<A>(), g_later.data_ptr<A>(), s_all.data_ptr<A>(),
        gs_all.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Backward phase 2 launch shape: warps (one child each) and groups of examples.
struct ChildPlan {
  int64_t warps, groups, per_group;
  size_t smem;
};

// warp_scratch: shared values per warp (the general kernel's uh, gu, c, gb and dW; the fast kernel's dW).
ChildPlan plan_children(const char* op, const RoutingDims& n, bool full, bool weights, size_t acc_bytes,
                        int64_t warp_scratch) {
  const size_t limit = shared_limit();
  const int64_t nt = full ? n.r : 1;
  auto bytes = [&](int64_t warps) { return acc_bytes * static_cast<size_t>(2 * nt * n.JD + warps * warp_scratch); };
  int64_t warps = kWarpsPerBlock;
  while (bytes(warps) > limit && warps > 1) warps /= 2;
  TORCH_CHECK(bytes(warps) <= limit, op, ": the backward kernel needs ", bytes(warps),
              " bytes of shared memory per block for J * D = ", n.JD, ", Din = ", n.Din, " and ", n.r,
              " iterations; the device has ", limit);
  const int64_t blocks_x = ceil_div(n.I, warps);
  // With weights every group writes its own dW partial sums: at least four blocks per multiprocessor and
  // at most 32 examples per block (long blocks leave a tail of idle multiprocessors). Without, one example
  // per block (up to the grid's limit).
  int64_t groups = weights ? std::clamp<int64_t>(std::max(ceil_div(4 * sm_count(), blocks_x), ceil_div(n.B, 32)), 1, n.B)
                           : std::min<int64_t>(n.B, 65535);
  const int64_t per_group = ceil_div(n.B, groups);
  groups = ceil_div(n.B, per_group);
  return {warps, groups, per_group, bytes(warps)};
}

dim3 child_grid(const ChildPlan& p, const RoutingDims& n) {
  return dim3(static_cast<unsigned>(ceil_div(n.I, p.warps)), static_cast<unsigned>(p.groups));
}

template <typename T, typename A, typename Pred, bool kWeights>
void launch_children(const ChildPlan& p, const Pred& pred, const RoutingDims& n, bool full, const at::Tensor& a_all,
                     const at::Tensor& gs_all, T* grad_u, A* dw_parts, T* grad_u_hat) {
  auto kernel = child_grad_kernel<T, A, Pred, kWeights>;
  allow_shared(kernel, p.smem);
  kernel<<<child_grid(p, n), static_cast<unsigned>(p.warps * kWarp), p.smem, at::cuda::getCurrentCUDAStream()>>>(
      pred, n, full, p.per_group, a_all.data_ptr<A>(), gs_all.data_ptr<A>(), grad_u, dw_parts, grad_u_hat);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int kSlots>
void launch_fast_children(const ChildPlan& p, const FastPass<T, kSlots>& pass, const RoutingDims& n, bool full,
                          const at::Tensor& a_all, const at::Tensor& gs_all, T* grad_u, float* dw_parts) {
  auto kernel = fast_child_kernel<T, kSlots>;
  allow_shared(kernel, p.smem);
  kernel<<<child_grid(p, n), static_cast<unsigned>(p.warps * kWarp), p.smem, at::cuda::getCurrentCUDAStream()>>>(
      pass.u, pass.w, n, full, p.per_group, a_all.data_ptr<float>(), gs_all.data_ptr<float>(), grad_u, dw_parts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Slots per lane of the fast kernels for these sizes, or 0 for the general kernels. The environment variable
// CAPSNET_CUDA_KERNEL=general forces the general kernels (the tests hold both to the CPU op).
int64_t fast_slots(const RoutingDims& n, at::ScalarType dtype) {
  const char* force = std::getenv("CAPSNET_CUDA_KERNEL");
  if (force != nullptr && std::string(force) == "general") return 0;
  if (dtype == at::kDouble || n.D != kFastD || n.Din != kFastDin || n.J < 1 || n.J > 16) return 0;
  return n.J <= 10 ? 5 : 8;
}

// Calls f(pass, slots) with the fused op's pass: FastPass<T, 5 or 8> where the fast kernels apply, else
// GeneralPass with u_hat recomputed from u and W (slots = 0).
template <typename T, typename A, typename F>
void with_fused_pass(const RoutingDims& n, const at::Tensor& u, const at::Tensor& W, F&& f) {
  const T* up = u.data_ptr<T>();
  const T* wp = W.data_ptr<T>();
  if constexpr (std::is_same_v<A, float>) {
    const int64_t slots = fast_slots(n, u.scalar_type());
    if (slots == 5) return f(FastPass<T, 5>{up, wp}, std::integral_constant<int, 5>{});
    if (slots == 8) return f(FastPass<T, 8>{up, wp}, std::integral_constant<int, 8>{});
  }
  f(GeneralPass<T, A, WeightPredictor<T, A>>{WeightPredictor<T, A>{up, wp, n.I, n.JD, n.Din}},
    std::integral_constant<int, 0>{});
}

// Grid limits: the examples run along the grid's y axis (at most 65535 blocks).
void check_sizes(const char* op, const RoutingDims& n) {
  TORCH_CHECK(n.B <= 65535, op, ": a batch of ", n.B, " examples is more than the CUDA kernels take in one call (65535)");
  TORCH_CHECK(n.I < (int64_t{1} << 31), op, ": I = ", n.I, " input capsules is more than the CUDA kernels take");
}

// ---------------------------------------------------------------------------------------------------
// Dispatcher kernels.

std::tuple<at::Tensor, at::Tensor> capsule_routing_forward_cuda(const at::Tensor& u_in, const at::Tensor& W_in,
                                                                int64_t iterations) {
  detail::check_capsule_routing_inputs(kFusedOp, u_in, W_in);
  detail::check_iterations(kFusedOp, iterations);
  const c10::cuda::CUDAGuard guard(u_in.device());
  const auto u = u_in.contiguous(), W = W_in.contiguous();
  const RoutingDims n{u.size(0), W.size(0), W.size(1), W.size(2), W.size(3), iterations, W.size(1) * W.size(2)};
  check_sizes(kFusedOp, n);
  auto v = at::empty({n.B, n.J, n.D}, u.options());
  auto s_all = at::empty({n.B, n.r, n.J, n.D}, u.options().dtype(detail::state_dtype(u.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "capsule_routing_forward_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    with_fused_pass<scalar_t, A>(n, u, W, [&](const auto& pass, auto /*slots*/) {
      run_forward<scalar_t, A>(kFusedOp, pass, n, v, s_all);
    });
  });
  return {v, s_all};
}

std::tuple<at::Tensor, at::Tensor> capsule_routing_backward_cuda(const at::Tensor& grad_v_in, const at::Tensor& u_in,
                                                                 const at::Tensor& W_in, const at::Tensor& s_all_in,
                                                                 bool grad_through_routing) {
  detail::check_capsule_routing_inputs(kFusedOp, u_in, W_in);
  const c10::cuda::CUDAGuard guard(u_in.device());
  const auto u = u_in.contiguous(), W = W_in.contiguous();
  const RoutingDims n{u.size(0),    W.size(0), W.size(1), W.size(2), W.size(3), s_all_in.dim() == 4 ? s_all_in.size(1) : 0,
                      W.size(1) * W.size(2)};
  detail::check_backward_state(kFusedOp, grad_v_in, s_all_in, n.B, n.J, n.D, u);
  check_sizes(kFusedOp, n);
  const auto grad_v = grad_v_in.contiguous(), s_all = s_all_in.contiguous();
  const bool full = grad_through_routing;
  auto grad_u = at::zeros_like(u);
  if (n.B == 0 || n.JD == 0 || n.I == 0 || n.Din == 0) return {grad_u, at::zeros_like(W)};
  auto a_all = at::empty_like(s_all);
  auto gs_all = at::zeros_like(s_all);
  at::Tensor grad_W;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "capsule_routing_backward_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    with_fused_pass<scalar_t, A>(n, u, W, [&](const auto& pass, auto slots) {
      constexpr int kSlots = decltype(slots)::value;
      run_backward_state<scalar_t, A>(kFusedOp, pass, n, full, grad_v, s_all, a_all, gs_all);
      const int64_t scratch = kSlots > 0 ? n.Din * n.JD : 2 * n.JD + 2 * n.J + n.Din * n.JD;
      const ChildPlan p = plan_children(kFusedOp, n, full, true, sizeof(A), scratch);
      auto dw_parts = at::empty({p.groups, n.I, n.JD * n.Din}, s_all.options());  // A
      if constexpr (kSlots > 0) {
        launch_fast_children<scalar_t, kSlots>(p, pass, n, full, a_all, gs_all, grad_u.data_ptr<scalar_t>(),
                                               dw_parts.data_ptr<float>());
      } else {
        launch_children<scalar_t, A, WeightPredictor<scalar_t, A>, true>(
            p, pass.pred, n, full, a_all, gs_all, grad_u.data_ptr<scalar_t>(), dw_parts.data_ptr<A>(), nullptr);
      }
      grad_W = (p.groups == 1 ? dw_parts[0] : dw_parts.sum(0)).to(u.scalar_type()).view({n.I, n.J, n.D, n.Din});
    });
  });
  return {grad_u, grad_W};
}

std::tuple<at::Tensor, at::Tensor> routing_from_predictions_forward_cuda(const at::Tensor& u_hat_in,
                                                                         int64_t iterations) {
  detail::check_predictions_input(kPredOp, u_hat_in);
  detail::check_iterations(kPredOp, iterations);
  const c10::cuda::CUDAGuard guard(u_hat_in.device());
  const auto u_hat = u_hat_in.contiguous();
  const RoutingDims n{u_hat.size(0), u_hat.size(1), u_hat.size(2), u_hat.size(3), 0, iterations,
                      u_hat.size(2) * u_hat.size(3)};
  check_sizes(kPredOp, n);
  auto v = at::empty({n.B, n.J, n.D}, u_hat.options());
  auto s_all = at::empty({n.B, n.r, n.J, n.D}, u_hat.options().dtype(detail::state_dtype(u_hat.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u_hat.scalar_type(), "routing_from_predictions_forward_cuda",
                                  [&] {
                                    using A = at::opmath_type<scalar_t>;
                                    const GeneralPass<scalar_t, A, StoredPredictor<scalar_t, A>> pass{
                                        StoredPredictor<scalar_t, A>{u_hat.data_ptr<scalar_t>(), n.I, n.JD}};
                                    run_forward<scalar_t, A>(kPredOp, pass, n, v, s_all);
                                  });
  return {v, s_all};
}

at::Tensor routing_from_predictions_backward_cuda(const at::Tensor& grad_v_in, const at::Tensor& u_hat_in,
                                                  const at::Tensor& s_all_in, bool grad_through_routing) {
  detail::check_predictions_input(kPredOp, u_hat_in);
  const c10::cuda::CUDAGuard guard(u_hat_in.device());
  const auto u_hat = u_hat_in.contiguous();
  const RoutingDims n{u_hat.size(0), u_hat.size(1), u_hat.size(2), u_hat.size(3), 0,
                      s_all_in.dim() == 4 ? s_all_in.size(1) : 0, u_hat.size(2) * u_hat.size(3)};
  detail::check_backward_state(kPredOp, grad_v_in, s_all_in, n.B, n.J, n.D, u_hat);
  check_sizes(kPredOp, n);
  const auto grad_v = grad_v_in.contiguous(), s_all = s_all_in.contiguous();
  const bool full = grad_through_routing;
  auto grad_u_hat = at::empty_like(u_hat);
  if (u_hat.numel() == 0) return grad_u_hat;
  auto a_all = at::empty_like(s_all);
  auto gs_all = at::zeros_like(s_all);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u_hat.scalar_type(),
                                  "routing_from_predictions_backward_cuda", [&] {
                                    using A = at::opmath_type<scalar_t>;
                                    const GeneralPass<scalar_t, A, StoredPredictor<scalar_t, A>> pass{
                                        StoredPredictor<scalar_t, A>{u_hat.data_ptr<scalar_t>(), n.I, n.JD}};
                                    run_backward_state<scalar_t, A>(kPredOp, pass, n, full, grad_v, s_all, a_all,
                                                                    gs_all);
                                    const ChildPlan p =
                                        plan_children(kPredOp, n, full, false, sizeof(A), 2 * n.JD + 2 * n.J);
                                    launch_children<scalar_t, A, StoredPredictor<scalar_t, A>, false>(
                                        p, pass.pred, n, full, a_all, gs_all, nullptr, nullptr,
                                        grad_u_hat.data_ptr<scalar_t>());
                                  });
  return grad_u_hat;
}

at::Tensor capsule_routing_cuda(const at::Tensor& u, const at::Tensor& W, int64_t iterations,
                                bool /*grad_through_routing: forward values do not depend on it*/) {
  return std::get<0>(capsule_routing_forward_cuda(u, W, iterations));
}

at::Tensor routing_from_predictions_cuda(const at::Tensor& u_hat, int64_t iterations, bool /*grad_through_routing*/) {
  return std::get<0>(routing_from_predictions_forward_cuda(u_hat, iterations));
}

}  // namespace
}  // namespace capsnet::ops::cuda

TORCH_LIBRARY_IMPL(capsnet, CUDA, m) {
  using namespace capsnet::ops::cuda;
  m.impl("capsule_routing", &capsule_routing_cuda);
  m.impl("routing_from_predictions", &routing_from_predictions_cuda);
  m.impl("_capsule_routing_forward", &capsule_routing_forward_cuda);
  m.impl("_capsule_routing_backward", &capsule_routing_backward_cuda);
  m.impl("_routing_from_predictions_forward", &routing_from_predictions_forward_cuda);
  m.impl("_routing_from_predictions_backward", &routing_from_predictions_backward_cuda);
}
