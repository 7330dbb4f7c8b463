#include "capsnet/nn/cast_cache.h"

namespace capsnet::nn {

CastCache& CastCache::operator=(const CastCache&) {
  std::lock_guard<std::mutex> lock(mutex_);
  master_.clear();
  copy_ = torch::Tensor();
  return *this;
}

torch::Tensor CastCache::get(const torch::Tensor& t, torch::ScalarType dtype) {
  if (!t.defined()) return t;
  if (torch::GradMode::is_enabled()) {
    // Training: the optimizer step after this forward may change t without bumping its version counter
    // (LibTorch 1.13's SGD updates p.data()), so the kept copy is dropped; the cast joins the graph.
    std::lock_guard<std::mutex> lock(mutex_);
    copy_ = torch::Tensor();
    master_.clear();
    return t.to(dtype);
  }
  if (t.scalar_type() == dtype) return t.to(dtype);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!copy_.defined() || !master_.matches(t) || dtype_ != dtype) {
    copy_ = t.to(dtype);  // [same shape as t]
    master_.record(t);
    dtype_ = dtype;
    ++casts_;
  }
  return copy_;
}

int64_t CastCache::casts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return casts_;
}

torch::Tensor linear_at(torch::nn::Linear& linear, const torch::Tensor& x, Precision precision,
                        LinearCastCache& cache) {
  if (precision == Precision::kFloat32) return linear_at(linear, x, precision);  // no cast to keep
  const auto dtype = compute_dtype(precision);
  return torch::linear(x.to(dtype), cache.weight.get(linear->weight, dtype), cache.bias.get(linear->bias, dtype));
}

}  // namespace capsnet::nn
