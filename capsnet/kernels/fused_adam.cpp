// Compiled with -ffp-contract=off (capsnet/CMakeLists.txt): every multiply and add rounds where ATen's
// kernels round; the fused multiply-adds they do (add_ with alpha: Vectorized fmadd; addcmul_, contracted
// by the compiler in Debian's build) are written out.
#include "capsnet/kernels/fused_adam.h"

#include "capsnet/ops/cpu/isa.h"
#include "capsnet/kernels/adam_state.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#if CAPSNET_HAVE_X86_COPIES
#include <immintrin.h>
#endif

namespace capsnet::kernels {
namespace {

using ops::CpuIsa;

// The step's scalars in float, as ATen converts them (each computed in double first, as LibTorch does).
struct AdamScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, weight_decay, sqrt_bias_correction2, eps, neg_step_size;
  bool decay, amsgrad;
};

// One element, exactly as the vector bodies below (and ATen's kernels) compute it.
#define CAPSNET_ADAM_SCALAR_BODY                                                                  \
  float g = grad[i];                                                                              \
  if (s.decay) g = std::fma(p[i], s.weight_decay, g);                                             \
  const float mi = std::fma(g, s.one_minus_beta1, m[i] * s.beta1);                                \
  const float vi = std::fma(s.one_minus_beta2 * g, g, v[i] * s.beta2);                                  \
  float vd = vi;                                                                                  \
  if (s.amsgrad) {                                                                                \
    vd = (std::isnan(vi) || std::isnan(vmax[i])) ? std::numeric_limits<float>::quiet_NaN()       \
                                                 : std::max(vi, vmax[i]);                         \
    vmax[i] = vd;                                                                                 \
  }                                                                                               \
  const float d = std::sqrt(vd) / s.sqrt_bias_correction2 + s.eps;                                \
  p[i] = p[i] + (s.neg_step_size * mi) / d;                                                       \
  m[i] = mi;                                                                                      \
  v[i] = vi;

#if CAPSNET_HAVE_X86_COPIES
// One vector body for both widths: the ISA's operations, each a single intrinsic (no fusing beyond the
// two fmadds written out).
#define CAPSNET_AVX512_OP __attribute__((target("avx512f,avx2,fma"), always_inline)) static inline
struct Avx512 {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  CAPSNET_AVX512_OP V set1(float x) { return _mm512_set1_ps(x); }
  CAPSNET_AVX512_OP V load(const float* p) { return _mm512_loadu_ps(p); }
  CAPSNET_AVX512_OP void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  CAPSNET_AVX512_OP V add(V a, V b) { return _mm512_add_ps(a, b); }
  CAPSNET_AVX512_OP V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  CAPSNET_AVX512_OP V div(V a, V b) { return _mm512_div_ps(a, b); }
  CAPSNET_AVX512_OP V sqrt(V a) { return _mm512_sqrt_ps(a); }
  CAPSNET_AVX512_OP V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // maximum() with NaN propagation, as ATen's Vectorized<float>::maximum.
  CAPSNET_AVX512_OP V max_nan(V a, V b) {
    const __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_max_ps(a, b), nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  }
};

#define CAPSNET_AVX2_OP __attribute__((target("avx2,fma"), always_inline)) static inline
struct Avx2 {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  CAPSNET_AVX2_OP V set1(float x) { return _mm256_set1_ps(x); }
  CAPSNET_AVX2_OP V load(const float* p) { return _mm256_loadu_ps(p); }
  CAPSNET_AVX2_OP void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  CAPSNET_AVX2_OP V add(V a, V b) { return _mm256_add_ps(a, b); }
  CAPSNET_AVX2_OP V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  CAPSNET_AVX2_OP V div(V a, V b) { return _mm256_div_ps(a, b); }
  CAPSNET_AVX2_OP V sqrt(V a) { return _mm256_sqrt_ps(a); }
  CAPSNET_AVX2_OP V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  CAPSNET_AVX2_OP V max_nan(V a, V b) {  // unordered lanes: all ones, a NaN
    return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
};

// Elements [begin, end): whole vectors, then the tail one at a time with the same roundings. One body,
// compiled once per ISA (a template without the target attribute cannot inline the intrinsics).
#define CAPSNET_DEFINE_ADAM_RANGE(NAME, I, TARGET)                                                             \
  TARGET void NAME(float* p, const float* grad, float* m, float* v, float* vmax, int64_t begin, int64_t end,   \
                   const AdamScalars& s) {                                                                      \
    using V = I::V;                                                                                             \
    const V b1 = I::set1(s.beta1), omb1 = I::set1(s.one_minus_beta1), b2 = I::set1(s.beta2);                    \
    const V omb2 = I::set1(s.one_minus_beta2), wd = I::set1(s.weight_decay);                                     \
    const V c2 = I::set1(s.sqrt_bias_correction2), eps = I::set1(s.eps), step = I::set1(s.neg_step_size);       \
    int64_t i = begin;                                                                                          \
    for (; i + I::kLanes <= end; i += I::kLanes) {                                                              \
      V g = I::load(grad + i);                                                                                  \
      const V pi = I::load(p + i);                                                                              \
      if (s.decay) g = I::fmadd(pi, wd, g);                                                                     \
      const V mi = I::fmadd(g, omb1, I::mul(I::load(m + i), b1));                                               \
      const V vi = I::fmadd(I::mul(omb2, g), g, I::mul(I::load(v + i), b2));                                    \
      V vd = vi;                                                                                                \
      if (s.amsgrad) {                                                                                          \
        vd = I::max_nan(vi, I::load(vmax + i));                                                                 \
        I::store(vmax + i, vd);                                                                                 \
      }                                                                                                         \
      const V d = I::add(I::div(I::sqrt(vd), c2), eps);                                                         \
      I::store(p + i, I::add(pi, I::div(I::mul(step, mi), d)));                                                 \
      I::store(m + i, mi);                                                                                      \
      I::store(v + i, vi);                                                                                      \
    }                                                                                                           \
    for (; i < end; ++i) {                                                                                      \
      CAPSNET_ADAM_SCALAR_BODY                                                                                  \
    }                                                                                                           \
  }

CAPSNET_DEFINE_ADAM_RANGE(adam_range_avx512, Avx512, __attribute__((target("avx512f,avx2,fma"))))
CAPSNET_DEFINE_ADAM_RANGE(adam_range_avx2, Avx2, __attribute__((target("avx2,fma"))))
#endif

// LibTorch 1.13's Adam::step for one parameter (torch/csrc/api/src/optim/adam.cpp), the same ATen calls.
void aten_update(torch::Tensor& p, torch::Tensor grad, torch::optim::AdamParamState& state,
                 const torch::optim::AdamOptions& o, double bias_correction1, double bias_correction2) {
  const auto [beta1, beta2] = o.betas();
  if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
  state.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
  state.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  torch::Tensor denom;
  if (o.amsgrad()) {
    torch::max_out(state.max_exp_avg_sq(), state.exp_avg_sq(), state.max_exp_avg_sq());
    denom = (state.max_exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  } else {
    denom = (state.exp_avg_sq().sqrt() / std::sqrt(bias_correction2)).add_(o.eps());
  }
  p.addcdiv_(state.exp_avg(), denom, -(o.lr() / bias_correction1));
}

bool fusable(const torch::Tensor& p, const torch::Tensor& grad, const torch::optim::AdamParamState& state,
             bool amsgrad) {
  const auto dense_float = [&](const torch::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.layout() == torch::kStrided &&
           t.is_contiguous() && t.sizes() == p.sizes();
  };
  return dense_float(p) && dense_float(grad) && dense_float(state.exp_avg()) && dense_float(state.exp_avg_sq()) &&
         (!amsgrad || dense_float(state.max_exp_avg_sq()));
}

}  // namespace

torch::Tensor FusedAdam::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  const CpuIsa isa = ops::cpu::selected_isa();
  using Key = typename std::decay_t<decltype(state_)>::key_type;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const auto grad = p.grad();
      TORCH_CHECK(!grad.is_sparse(), "Adam does not support sparse gradients");
      const auto key = detail::adam_state_key<Key>(p);
      if (state_.find(key) == state_.end()) state_[key] = detail::new_adam_state(p, o.amsgrad());  // as LibTorch
      auto& state = static_cast<torch::optim::AdamParamState&>(*state_[key]);
      state.step(state.step() + 1);
      const auto [beta1, beta2] = o.betas();
      const double bias_correction1 = 1 - std::pow(beta1, state.step());
      const double bias_correction2 = 1 - std::pow(beta2, state.step());
#if CAPSNET_HAVE_X86_COPIES
      if (isa != CpuIsa::baseline && fusable(p, grad, state, o.amsgrad())) {
        const AdamScalars s{static_cast<float>(beta1),
                            static_cast<float>(1 - beta1),
                            static_cast<float>(beta2),
                            static_cast<float>(1 - beta2),
                            static_cast<float>(o.weight_decay()),
                            static_cast<float>(std::sqrt(bias_correction2)),
                            static_cast<float>(o.eps()),
                            static_cast<float>(-(o.lr() / bias_correction1)),
                            o.weight_decay() != 0,
                            o.amsgrad()};
        float* pp = p.data_ptr<float>();
        const float* gp = grad.data_ptr<float>();
        float* mp = state.exp_avg().data_ptr<float>();
        float* vp = state.exp_avg_sq().data_ptr<float>();
        float* vmaxp = o.amsgrad() ? state.max_exp_avg_sq().data_ptr<float>() : nullptr;
        // Each element is independent: any split gives the same bits.
        at::parallel_for(0, p.numel(), int64_t{1} << 15, [&](int64_t begin, int64_t end) {
          if (isa == CpuIsa::avx512)
            adam_range_avx512(pp, gp, mp, vp, vmaxp, begin, end, s);
          else
            adam_range_avx2(pp, gp, mp, vp, vmaxp, begin, end, s);
        });
        // Written through raw pointers: the version counters move as ATen's in-place ops move them, so that
        // whatever keeps a copy of a weight until it changes (kernels/weight_cache.h: the bf16 casts, the blocked
        // weights, the kept spectrum) sees the update.
        for (const auto* t : {&p, &state.exp_avg(), &state.exp_avg_sq()}) t->unsafeGetTensorImpl()->bump_version();
        if (o.amsgrad()) state.max_exp_avg_sq().unsafeGetTensorImpl()->bump_version();
        continue;
      }
#endif
      aten_update(p, grad, state, o, bias_correction1, bias_correction2);
    }
  }
  return loss;
}

std::unique_ptr<torch::optim::Adam> make_adam(std::vector<torch::Tensor> params,
                                              const torch::optim::AdamOptions& options) {
  return std::make_unique<FusedAdam>(std::move(params), options);
}

std::unique_ptr<torch::optim::Adam> make_adam(std::vector<torch::optim::OptimizerParamGroup> groups,
                                              const torch::optim::AdamOptions& options) {
  return std::make_unique<FusedAdam>(std::move(groups), options);
}

}  // namespace capsnet::kernels
