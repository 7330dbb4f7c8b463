#pragma once
// Derivatives of master weights kept for inference: a cast to the compute dtype (cast_cache.h), oneDNN's
// blocked reorder and the spectral form's weight spectrum (blocked_conv.h).
//
// Why: at batch 1 making them is most of a call (the decoder's bf16 casts, PrimaryCaps' 21 MB reorder),
// and without autograd nothing needs them to be part of a graph. A kept derivative is valid while each
// master it was made from is unchanged -- the same storage (not a load, not a new tensor) and the same
// version counter (no in-place optimizer step) -- and the caller asks for the same form (dtype, input size).
// This is that rule, once.

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace capsnet::kernels {

/// Tensors made from master tensors, kept until a master changes or another form is asked for. Safe to
/// call from several threads. A copy (of a cloned module) starts empty: it serves another module's weights.
class WeightCache {
 public:
  using Make = std::function<std::vector<torch::Tensor>()>;

  WeightCache() = default;
  WeightCache(const WeightCache&) {}
  WeightCache& operator=(const WeightCache&) {
    clear();
    return *this;
  }

  /// The tensors kept from the last make() when every master has the storage and version counter it had
  /// then (an undefined master matches only an undefined one) and `form` is the same; otherwise the kept
  /// tensors are dropped first (the old and the new are never held together), make() runs, and its result
  /// is kept and counted.
  std::vector<torch::Tensor> get(const std::vector<torch::Tensor>& masters, const std::vector<int64_t>& form,
                                 const Make& make) {
    std::vector<Stamp> now;
    now.reserve(masters.size());
    for (const auto& m : masters) now.push_back(stamp(m));
    std::lock_guard<std::mutex> lock(mutex_);
    if (!valid_ || stamps_ != now || form_ != form) {
      kept_.clear();
      valid_ = false;
      kept_ = make();
      stamps_ = std::move(now);
      form_ = form;
      valid_ = true;
      ++made_;
    }
    return kept_;
  }

  /// Drops what is kept (the next get makes it again).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.clear();
    stamps_.clear();
    valid_ = false;
  }

  /// How many times make() ran (tests: once per weight update, not per call).
  int64_t made() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return made_;
  }

 private:
  using Stamp = std::pair<const void*, int64_t>;  // storage, version counter
  static Stamp stamp(const torch::Tensor& t) {
    return t.defined() ? Stamp{t.data_ptr(), t._version()} : Stamp{nullptr, -1};
  }

  mutable std::mutex mutex_;
  bool valid_ = false;
  std::vector<Stamp> stamps_;
  std::vector<int64_t> form_;
  std::vector<torch::Tensor> kept_;
  int64_t made_ = 0;
};

}  // namespace capsnet::kernels
