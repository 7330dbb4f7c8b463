// Compiled with -ffp-contract=off (capsnet/CMakeLists.txt): every multiply and add rounds where ATen's
// kernels round; the fused multiply-adds they do (add_ with alpha: Vectorized fmadd; addcmul_, contracted
// by the compiler in Debian's build) are written out.
#include "capsnet/train/fused_adam.h"

#include "capsnet/ops/cpu/isa.h"
#include "capsnet/train/adam_state.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#if CAPSNET_HAVE_X86_COPIES
#include <immintrin.h>
#endif

namespace capsnet::train {
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
// maximum() with NaN propagation, as ATen's Vectorized<float>::maximum.
__attribute__((target("avx512f,avx2,fma"))) inline __m512 max_nan(__m512 a, __m512 b) {
  const __m512 mx = _mm512_max_ps(a, b);
  const __mmask16 nan = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(mx, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

__attribute__((target("avx512f,avx2,fma"))) void adam_range_avx512(float* p, const float* grad, float* m, float* v,
                                                                   float* vmax, int64_t begin, int64_t end,
                                                                   const AdamScalars& s) {
  const __m512 b1 = _mm512_set1_ps(s.beta1), omb1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(s.beta2), omb2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 wd = _mm512_set1_ps(s.weight_decay), c2 = _mm512_set1_ps(s.sqrt_bias_correction2);
  const __m512 eps = _mm512_set1_ps(s.eps), step = _mm512_set1_ps(s.neg_step_size);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 g = _mm512_loadu_ps(grad + i);
    const __m512 pi = _mm512_loadu_ps(p + i);
    if (s.decay) g = _mm512_fmadd_ps(pi, wd, g);
    const __m512 mi = _mm512_fmadd_ps(g, omb1, _mm512_mul_ps(_mm512_loadu_ps(m + i), b1));
    const __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, _mm512_mul_ps(_mm512_loadu_ps(v + i), b2));
    __m512 vd = vi;
    if (s.amsgrad) {
      vd = max_nan(vi, _mm512_loadu_ps(vmax + i));
      _mm512_storeu_ps(vmax + i, vd);
    }
    const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vd), c2), eps);
    _mm512_storeu_ps(p + i, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(step, mi), d)));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
  }
  for (; i < end; ++i) {
    CAPSNET_ADAM_SCALAR_BODY
  }
}

__attribute__((target("avx2,fma"))) inline __m256 max_nan(__m256 a, __m256 b) {
  const __m256 mx = _mm256_max_ps(a, b);
  return _mm256_or_ps(mx, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));  // unordered: all ones, a NaN
}

__attribute__((target("avx2,fma"))) void adam_range_avx2(float* p, const float* grad, float* m, float* v, float* vmax,
                                                         int64_t begin, int64_t end, const AdamScalars& s) {
  const __m256 b1 = _mm256_set1_ps(s.beta1), omb1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 wd = _mm256_set1_ps(s.weight_decay), c2 = _mm256_set1_ps(s.sqrt_bias_correction2);
  const __m256 eps = _mm256_set1_ps(s.eps), step = _mm256_set1_ps(s.neg_step_size);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_loadu_ps(grad + i);
    const __m256 pi = _mm256_loadu_ps(p + i);
    if (s.decay) g = _mm256_fmadd_ps(pi, wd, g);
    const __m256 mi = _mm256_fmadd_ps(g, omb1, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
    const __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    __m256 vd = vi;
    if (s.amsgrad) {
      vd = max_nan(vi, _mm256_loadu_ps(vmax + i));
      _mm256_storeu_ps(vmax + i, vd);
    }
    const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vd), c2), eps);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(step, mi), d)));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  for (; i < end; ++i) {
    CAPSNET_ADAM_SCALAR_BODY
  }
}
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
      if (state_.find(key) == state_.end()) {  // as LibTorch: zero moments at the first step
        auto s = std::make_unique<torch::optim::AdamParamState>();
        s->step(0);
        s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        if (o.amsgrad()) s->max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        state_[key] = std::move(s);
      }
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
        // whatever keeps a copy of a weight until it changes (nn/tensor_stamp.h: the bf16 casts, the blocked
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

}  // namespace capsnet::train
