#pragma once
// Process setup every capsnet program runs first (CLI, tests, benchmarks).

namespace capsnet {

/// 1. OpenBLAS 0.3.21 (Debian 12) does not recognise AVX-512 CPUs newer than it (e.g. AMD Zen 4)
///    and falls back to slow kernels; OPENBLAS_CORETYPE=SkylakeX measured 5x on large matmuls.
///    OpenBLAS reads it when the library loads, so if it is unset on such a CPU the process
///    re-executes itself once with it set (CAPSNET_NO_REEXEC=1 disables this).
/// 2. Torch intra-op threads = all cores (LibTorch defaults to 1 here), or $CAPSNET_THREADS.
void configure_runtime(int argc, char** argv);

/// Sets torch's intra-op thread count; n <= 0 means all cores.
void set_threads(int n);

}  // namespace capsnet
