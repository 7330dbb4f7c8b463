#pragma once
// What a kept derivative of a weight (a cast, a blocked reorder, a spectrum) was made from.
//
// The inference caches (CastCache, BlockedConvWeights) keep a copy of a master weight in another form
// until the master changes: its storage (a load, a new tensor) or its version counter (an in-place
// optimizer step). This is that test, once.

#include <torch/torch.h>

namespace capsnet::nn {

/// A tensor's storage and version counter at the time a kept copy was made from it. The caller keeps the
/// copy itself and checks that it exists.
class TensorStamp {
 public:
  /// True when t has the storage and version recorded last.
  bool matches(const torch::Tensor& t) const { return data_ == t.data_ptr() && version_ == t._version(); }
  void record(const torch::Tensor& t) {
    data_ = t.data_ptr();
    version_ = t._version();
  }
  void clear() {
    data_ = nullptr;
    version_ = -1;
  }

 private:
  const void* data_ = nullptr;
  int64_t version_ = -1;
};

}  // namespace capsnet::nn
