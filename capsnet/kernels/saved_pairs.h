#pragma once
// Pairs of sizes (stride, padding, ...) kept in an autograd context's saved_data, which stores
// IValues: a std::array goes in as a vector of ints and comes back out of it. Internal to nn/'s
// custom autograd functions.

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <vector>

namespace capsnet::kernels::detail {

inline std::vector<int64_t> as_vector(const std::array<int64_t, 2>& a) { return {a[0], a[1]}; }

inline std::array<int64_t, 2> as_array(const c10::IValue& v) {
  const auto list = v.toIntVector();
  return {list[0], list[1]};
}

}  // namespace capsnet::kernels::detail
