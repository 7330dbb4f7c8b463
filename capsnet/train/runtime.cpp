#include "capsnet/train/runtime.h"

#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

namespace capsnet {

void set_threads(int n) {
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
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
  const char* threads = std::getenv("CAPSNET_THREADS");
  set_threads(threads ? std::atoi(threads) : 0);
}

}  // namespace capsnet
