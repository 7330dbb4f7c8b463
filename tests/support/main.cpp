// Test main: the same process setup as the CLI (BLAS core type, all cores), then GoogleTest.
#include <gtest/gtest.h>

#include <cstdlib>

#include "apps/runtime.h"

int main(int argc, char** argv) {
  // --precision auto by the rule, not by a timing probe: the suite's runs must not depend on timing
  // (apps/precision_probe.h; the probe's own tests set their cache directory and unset this).
  ::setenv("CAPSNET_PRECISION_AUTO", "cpuid", /*overwrite=*/0);
  capsnet::apps::configure_runtime(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
