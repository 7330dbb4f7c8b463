#pragma once
// The training-loop options the loop and experiment tests start from.

#include <string>

#include "capsnet/train/loop.h"

namespace capsnet::testing {

/// Loop options writing to out_dir with batches of batch_size and no progress bar; the rest default.
inline train::LoopOptions quiet_loop(const std::string& out_dir, int64_t batch_size) {
  train::LoopOptions o;
  o.out_dir = out_dir;
  o.batch_size = batch_size;
  o.progress = false;
  return o;
}

}  // namespace capsnet::testing
