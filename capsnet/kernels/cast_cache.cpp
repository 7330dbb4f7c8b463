#include "capsnet/kernels/cast_cache.h"

#include "capsnet/kernels/conv_dispatch.h"

namespace capsnet::kernels {

torch::Tensor CastCache::get(const torch::Tensor& t, torch::ScalarType dtype) {
  if (!t.defined()) return t;
  if (torch::GradMode::is_enabled()) {
    // Training: the optimizer step after this forward may change t without bumping its version counter
    // (LibTorch 1.13's SGD updates p.data()), so the kept copy is dropped; the cast joins the graph.
    cache_.clear();
    return t.to(dtype);
  }
  if (t.scalar_type() == dtype) return t.to(dtype);
  // [same shape as t]
  return cache_.get({t}, {static_cast<int64_t>(dtype)}, [&] { return std::vector<torch::Tensor>{t.to(dtype)}; })[0];
}

torch::Tensor linear_at(torch::nn::Linear& linear, const torch::Tensor& x, Precision precision,
                        LinearCastCache& cache) {
  if (precision == Precision::kFloat32) return linear_at(linear, x, precision);  // no cast to keep
  const auto dtype = compute_dtype(precision);
  return torch::linear(x.to(dtype), cache.weight.get(linear->weight, dtype), cache.bias.get(linear->bias, dtype));
}

}  // namespace capsnet::kernels
