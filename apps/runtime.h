#pragma once
// Process setup every capsnet program runs first (CLI, tests, benchmarks).

namespace capsnet::apps {

/// 1. OpenBLAS 0.3.21 (Debian 12) can mis-detect AVX-512 CPUs newer than it and fall back to slow
///    kernels (5x on large matmuls where it did); OPENBLAS_CORETYPE=SkylakeX avoids that and costs
///    nothing where detection works (docs/results.md). OpenBLAS reads it when the library loads, so
///    if it is unset on an AVX-512 CPU the process re-executes itself once with it set
///    (CAPSNET_NO_REEXEC=1 disables this).
/// 2. OpenBLAS runs 1 thread unless OPENBLAS_NUM_THREADS is set (its threads fought ATen's on
///    2 cores: docs/kernels.md); the variable is exported to child processes.
/// 3. Torch intra-op threads = all cores (LibTorch defaults to 1 here), or $CAPSNET_THREADS.
void configure_runtime(int argc, char** argv);

/// Sets OpenBLAS's thread count in this process and returns the previous one; -1 (and nothing
/// set) when the BLAS loaded is not OpenBLAS.
int set_blas_threads(int n);

/// The most intra-op threads a capsnet program starts (--threads and CAPSNET_THREADS).
inline constexpr int kMaxThreads = 256;

/// Sets torch's intra-op thread count; n <= 0 means all cores, more than kMaxThreads is capped.
void set_threads(int n);

}  // namespace capsnet::apps
