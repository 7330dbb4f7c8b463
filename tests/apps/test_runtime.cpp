// apps/runtime.h: the process setup every executable (and this test binary, tests/support/main.cpp) runs.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "apps/runtime.h"

namespace capsnet {
namespace {

// OpenBLAS's own threads beside ATen's made fp32 batch-1 latency bimodal (docs/kernels.md): the
// runtime pins OpenBLAS to one thread, in this process and (through the variable) in its children.
TEST(Runtime, OpenBlasRunsOneThreadBesideAtensThreads) {
  const char* value = std::getenv("OPENBLAS_NUM_THREADS");
  ASSERT_NE(value, nullptr);
  if (std::string(value) != "1") GTEST_SKIP() << "OPENBLAS_NUM_THREADS=" << value << " was set by the user";
  using GetThreads = int (*)();
  const auto get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (!get) GTEST_SKIP() << "the BLAS in this process is not OpenBLAS";
  EXPECT_EQ(get(), 1);
}

}  // namespace
}  // namespace capsnet
