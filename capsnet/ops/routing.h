#pragma once
// Fused dynamic-routing operators (Sabour, Frosst & Hinton 2017, Procedure 1), registered with the
// dispatcher as capsnet::capsule_routing and capsnet::routing_from_predictions (library.cpp).
// These C++ wrappers call the dispatcher, so autograd and the per-device kernels apply; from Python:
//   torch.ops.load_library("libcapsnet_ops.so"); torch.ops.capsnet.capsule_routing(u, W, 3, True)
//
// Math per example b (softmax over the parents j; A^t = sum_{t'<t} v^(t'), A^0 = 0):
//   u_hat_{j|i} = W_ij u_i,  c_i^t = softmax_j(u_hat_{j|i} . A_j^t),  s_j^t = sum_i c_ij^t u_hat_{j|i},
//   v^t = squash(s^t) (eps = kSquashEps inside the sqrt), output v^(r-1).
// This equals capsnet::dynamic_routing / detail::reference_routing (b_ij = u_hat_{j|i} . A_j^t), in
// both gradient modes. Only per-example [r, J, D] state is kept; u_hat is recomputed on the fly
// (small batches keep it within the forward: set_prediction_cache_bytes).
// Derivation of the backward pass and memory argument: docs/kernels.md.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace capsnet::ops {

/// Epsilon inside the squash norm; equal to capsnet::kNormEps (the ops library may not include nn/).
inline constexpr double kSquashEps = 1e-8;

/// Fused prediction + routing (DigitCaps without materialising u_hat).
/// u: [B, I, Din] child capsules u_i; W: [I, J, D, Din] matrices W_ij (same dtype float32/float64, same
/// device); iterations r >= 1. Returns v: [B, J, D].
/// grad_through_routing = true: full gradient through every iteration (authors' code);
/// false: the coupling coefficients c_ij are constants, only the final s_j = sum_i c_ij u_hat carries gradient.
at::Tensor capsule_routing(const at::Tensor& u, const at::Tensor& W, int64_t iterations = 3,
                           bool grad_through_routing = true);

/// Routing on precomputed predictions (the same kernel with u_hat read instead of recomputed).
/// u_hat: [B, I, J, D] prediction vectors u_hat_{j|i}. Returns v: [B, J, D].
at::Tensor routing_from_predictions(const at::Tensor& u_hat, int64_t iterations = 3, bool grad_through_routing = true);

/// The CPU kernels exist once per instruction set: baseline (SSE2 on x86-64), AVX2+FMA and AVX-512,
/// the widest the CPU has chosen at run time. set_cpu_isa caps the choice in this process (a cap above
/// what the CPU has gives the widest it has); automatic (the default) restores the choice by CPU.
/// Tests and benchmarks use it to compare the copies.
enum class CpuIsa { automatic, baseline, avx2, avx512 };
void set_cpu_isa(CpuIsa isa);

/// Two layouts of the fused op's CPU kernels: per_example (one example at a time, vectors over J*D) and
/// example_lanes (one SIMD lane per example, vectors over the batch, as narrow as the batch allows:
/// 4, 8 or 16 float32 lanes). automatic (the default) is example_lanes: several times faster at batch
/// 100, on par at batch 1, and an example's outputs are bit-identical whatever batch it is routed in.
/// set_cpu_kernel forces one (tests hold both to the oracle); routing_from_predictions always runs per
/// example.
enum class CpuKernel { automatic, per_example, example_lanes };
void set_cpu_kernel(CpuKernel kernel);

/// The example-lane forward keeps the predictions u_hat of iteration 1 for the later iterations
/// instead of recomputing them, when they fit in this many bytes ([ceil(B / L), I, J*D, L] in lanes:
/// for the paper's CapsNet 2.9 MB at B <= 4, 5.9 MB at B <= 8; 11.8 MB at B = 16 measured slower than
/// recomputing, 82 MB at B = 100). The outputs are
/// bit-identical either way; only the speed of small batches changes. Negative restores the default
/// (kPredictionCacheBytes); 0 turns the cache off. Tests and benchmarks compare the two.
constexpr int64_t kPredictionCacheBytes = int64_t{8} << 20;
void set_prediction_cache_bytes(int64_t bytes);

}  // namespace capsnet::ops
