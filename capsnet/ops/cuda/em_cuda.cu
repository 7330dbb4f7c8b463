// CUDA kernels of EM routing's vote passes (em.h), registered for the CUDA dispatch key; device code in
// em_kernels.cuh. float32 / float64, and float16 / bfloat16 with float32 accumulation. Launches go on the
// current stream; nothing synchronises with the host.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "capsnet/ops/cuda/em_kernels.cuh"
#include "capsnet/ops/em_checks.h"

namespace capsnet::ops::cuda {
namespace {

constexpr const char* kMomentsOp = "capsnet::em_weighted_moments";
constexpr const char* kDistanceOp = "capsnet::em_scaled_distance";
constexpr int kThreads = 256;

EmDims dims_of(const at::Tensor& votes) { return {votes.size(0), votes.size(1), votes.size(2), votes.size(3)}; }

// Blocks for `count` threads of a grid-stride loop (capped; the loop covers the rest).
unsigned blocks_for(int64_t count) {
  const int64_t cap = int64_t{32} * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::clamp<int64_t>((count + kThreads - 1) / kThreads, 1, cap));
}


std::tuple<at::Tensor, at::Tensor> em_weighted_moments_cuda(const at::Tensor& weights_in, const at::Tensor& votes_in) {
  detail::check_moments_inputs(kMomentsOp, weights_in, votes_in);
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const auto w = weights_in.contiguous(), V = votes_in.contiguous();
  const EmDims n = dims_of(V);
  auto mean = at::empty({n.B, n.J, n.D}, V.options()), var = at::empty({n.B, n.J, n.D}, V.options());
  if (mean.numel() == 0) return {mean, var};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, V.scalar_type(), "em_weighted_moments_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    em_moments_kernel<scalar_t, A><<<blocks_for(mean.numel()), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        n, w.data_ptr<scalar_t>(), V.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), var.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {mean, var};
}

std::tuple<at::Tensor, at::Tensor> em_weighted_moments_backward_cuda(const at::Tensor& grad_mean,
                                                                     const at::Tensor& grad_variance,
                                                                     const at::Tensor& weights_in,
                                                                     const at::Tensor& votes_in,
                                                                     const at::Tensor& mean_in) {
  const auto in = detail::moments_grad_inputs(kMomentsOp, grad_mean, grad_variance, weights_in, votes_in, mean_in);
  const auto &w = in.weights, &V = in.votes, &mean = in.mean, &gm = in.grad_mean, &gv = in.grad_variance;
  const c10::cuda::CUDAGuard guard(V.device());
  const EmDims n = dims_of(V);
  auto gw = at::empty_like(w), gV = at::empty_like(V);
  if (gw.numel() == 0) return {gw, gV.zero_()};
  if (mean.numel() == 0) return {gw.zero_(), gV};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, V.scalar_type(), "em_weighted_moments_backward_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto stream = at::cuda::getCurrentCUDAStream();
    auto g1 = at::empty({n.B, n.J, n.D}, V.options().dtype(c10::CppTypeToScalarType<A>::value));
    em_moments_grad_mean_kernel<scalar_t, A><<<blocks_for(g1.numel()), kThreads, 0, stream>>>(
        n, gm.data_ptr<scalar_t>(), gv.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(),
        g1.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    em_moments_grad_kernel<scalar_t, A><<<blocks_for(gw.numel()), kThreads, 0, stream>>>(
        n, g1.data_ptr<A>(), gv.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), V.data_ptr<scalar_t>(),
        mean.data_ptr<scalar_t>(), gw.data_ptr<scalar_t>(), gV.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {gw, gV};
}

at::Tensor em_scaled_distance_cuda(const at::Tensor& votes_in, const at::Tensor& mean_in, const at::Tensor& var_in) {
  const auto in = detail::distance_inputs(kDistanceOp, votes_in, mean_in, var_in);
  const auto &V = in.votes, &mean = in.mean, &var = in.variance;
  const c10::cuda::CUDAGuard guard(V.device());
  const EmDims n = dims_of(V);
  auto dist = at::empty({n.B, n.I, n.J}, V.options());
  if (dist.numel() == 0) return dist;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, V.scalar_type(), "em_scaled_distance_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    em_distance_kernel<scalar_t, A><<<blocks_for(dist.numel()), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        n, V.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), var.data_ptr<scalar_t>(), dist.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dist;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_scaled_distance_backward_cuda(const at::Tensor& grad_distance,
                                                                                const at::Tensor& votes_in,
                                                                                const at::Tensor& mean_in,
                                                                                const at::Tensor& var_in) {
  const auto in = detail::distance_inputs(kDistanceOp, votes_in, mean_in, var_in, &grad_distance);
  const auto &V = in.votes, &mean = in.mean, &var = in.variance, &g = in.grad_distance;
  const c10::cuda::CUDAGuard guard(V.device());
  const EmDims n = dims_of(V);
  auto gV = at::empty_like(V), gmean = at::empty_like(mean), gvar = at::empty_like(var);
  if (V.numel() == 0) return {gV, gmean.zero_(), gvar.zero_()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, V.scalar_type(), "em_scaled_distance_backward_cuda", [&] {
    using A = at::opmath_type<scalar_t>;
    const auto stream = at::cuda::getCurrentCUDAStream();
    em_distance_grad_votes_kernel<scalar_t, A><<<blocks_for(g.numel()), kThreads, 0, stream>>>(
        n, g.data_ptr<scalar_t>(), V.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), var.data_ptr<scalar_t>(),
        gV.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    em_distance_grad_moments_kernel<scalar_t, A><<<blocks_for(gmean.numel()), kThreads, 0, stream>>>(
        n, g.data_ptr<scalar_t>(), V.data_ptr<scalar_t>(), mean.data_ptr<scalar_t>(), var.data_ptr<scalar_t>(),
        gmean.data_ptr<scalar_t>(), gvar.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {gV, gmean, gvar};
}

}  // namespace
}  // namespace capsnet::ops::cuda

TORCH_LIBRARY_IMPL(capsnet, CUDA, m) {
  using namespace capsnet::ops::cuda;
  m.impl("em_weighted_moments", &em_weighted_moments_cuda);
  m.impl("_em_weighted_moments_backward", &em_weighted_moments_backward_cuda);
  m.impl("em_scaled_distance", &em_scaled_distance_cuda);
  m.impl("_em_scaled_distance_backward", &em_scaled_distance_backward_cuda);
}
