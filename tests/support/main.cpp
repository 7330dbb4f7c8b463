// Test main: the same process setup as the CLI (BLAS core type, all cores), then GoogleTest.
#include <gtest/gtest.h>

#include "apps/runtime.h"

int main(int argc, char** argv) {
  capsnet::apps::configure_runtime(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
