#include "apps/runtime.h"

#include <torch/torch.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace capsnet::apps {

void set_threads(int n) {
  n = std::min(n, kMaxThreads);
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
}

int set_blas_threads(int n) {
  using Get = int (*)();
  using Set = void (*)(int);
  const auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  const auto set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!get || !set) return -1;
  const int before = get();
  set(n);
  return before;
}

void configure_runtime(int /*argc*/, char** argv) {
  const bool can_reexec = std::getenv("CAPSNET_NO_REEXEC") == nullptr && argv && argv[0];
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr && can_reexec) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
      setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
      setenv("CAPSNET_NO_REEXEC", "1", 1);  // never loop
      execv("/proc/self/exe", argv);
      // execv only returns on failure: carry on with the detected core type.
    }
#endif
  }
  // OpenBLAS (the fp32 linear layers) must not start its own threads beside ATen's: on 2 cores they
  // fight, and a batch-1 forward then waits for scheduler ticks (measured: fp32 batch-1 2.7-2.9 ms with
  // one BLAS thread, 8 ms with a p90 up to 66 ms with OpenBLAS's default; training +5%). The library
  // read its environment before main, so it is also told directly; the variable reaches the
  // processes we start (--nproc workers, bench's Python peers), so they run under the same setting.
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) {
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    set_blas_threads(1);
  }
  // CAPSNET_THREADS follows --threads' documented range (0..256, 0 = all cores); anything else is
  // ignored with a notice rather than trying to start 100000 threads.
  const char* threads = std::getenv("CAPSNET_THREADS");
  int n = 0;
  if (threads && *threads) {
    char* end = nullptr;
    const long v = std::strtol(threads, &end, 10);
    if (*end != '\0' || v < 0 || v > kMaxThreads)
      std::fprintf(stderr, "capsnet: ignoring CAPSNET_THREADS=%s (must be 0..%d)\n", threads, kMaxThreads);
    else
      n = static_cast<int>(v);
  }
  set_threads(n);
}

}  // namespace capsnet::apps
