#!/bin/bash
# Checks the CUDA device code (capsnet/ops/cuda/*.cuh) with clang's CUDA front end on a machine without
# nvcc or CUDA headers: parses and instantiates every kernel for float and double (not Half / BFloat16,
# whose headers need CUDA's). A syntax and template check only; nothing is compiled to GPU code, and the
# host files (*.cu) are checked only where nvcc exists (scripts/device_check.sh).
# Usage: scripts/check_cuda_syntax.sh   (needs clang++; exit status 0 when clean)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang++ >/dev/null || { echo "check_cuda_syntax: clang++ not found (apt install clang)"; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The few CUDA declarations the device code uses, for clang without CUDA's headers.
cat > "$tmp/shim.h" <<'SHIM'
#define __host__ __attribute__((host))
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define INFINITY (__builtin_inff())
#include <__clang_cuda_builtin_vars.h>
__device__ float expf(float);
__device__ double exp(double);
__device__ float sqrtf(float);
__device__ float fmaxf(float, float);
__device__ double sqrt(double);
__device__ void __syncthreads();
__device__ void __syncwarp(unsigned mask = 0xffffffffu);
__device__ float __shfl_xor_sync(unsigned, float, int, int = 32);
__device__ double __shfl_xor_sync(unsigned, double, int, int = 32);
SHIM
cat > "$tmp/instantiate.cu" <<'INST'
#include "capsnet/ops/cuda/routing_kernels.cuh"
#include "capsnet/ops/cuda/routing_fast_kernels.cuh"
#include "capsnet/ops/cuda/em_kernels.cuh"
using namespace capsnet::ops::cuda;
template <typename T, typename A>
void instantiate() {
  using W = WeightPredictor<T, A>;
  using S = StoredPredictor<T, A>;
  (void)&routing_pass_kernel<T, A, W>;
  (void)&routing_pass_kernel<T, A, S>;
  (void)&forward_finish_kernel<T, A>;
  (void)&backward_init_kernel<T, A>;
  (void)&backward_step_kernel<A>;
  (void)&child_grad_kernel<T, A, W, true>;
  (void)&child_grad_kernel<T, A, S, false>;
  (void)&em_moments_kernel<T, A>;
  (void)&em_moments_grad_mean_kernel<T, A>;
  (void)&em_moments_grad_kernel<T, A>;
  (void)&em_distance_kernel<T, A>;
  (void)&em_distance_grad_votes_kernel<T, A>;
  (void)&em_distance_grad_moments_kernel<T, A>;
}
template <int kSlots>
void instantiate_fast() {
  (void)&fast_pass_kernel<float, kSlots>;
  (void)&fast_child_kernel<float, kSlots>;
}
template void instantiate<float, float>();
template void instantiate_fast<5>();
template void instantiate_fast<8>();
template void instantiate<double, double>();
INST
for side in --cuda-device-only --cuda-host-only; do
  clang++ -x cuda "$side" --cuda-gpu-arch=sm_80 -nocudainc -nocudalib -std=c++17 -fsyntax-only \
    -Wall -Wextra -Wno-unknown-cuda-version -I. -include "$tmp/shim.h" "$tmp/instantiate.cu"
done
echo "check_cuda_syntax: capsnet/ops/cuda/*.cuh parse and instantiate (float, double)"
