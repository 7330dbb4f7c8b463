#pragma once
// Float64 finite-difference gradient checker for the unit tests (header-only).
//
// The function's output is reduced to the scalar f = sum(out * R) with a fixed random R of the
// output's shape, so that every output element contributes to the checked gradient. The autograd
// gradient df/dx is then compared with the central difference (f(x + eps) - f(x - eps)) / (2 eps)
// for every element of every input that requires grad (or a seeded random subset of them).
//
// Inputs are perturbed in place, through their storage: an input may therefore be a module's
// parameter that the function reads directly (the function may ignore its argument).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace capsnet::testing {

struct GradcheckOptions {
  double eps = 1e-6;   // central-difference step
  double atol = 1e-6;  // pass if |analytic - numeric| <= atol + rtol * |numeric|
  double rtol = 1e-4;
  int64_t max_elements = 0;  // checked elements per input; <= 0 means all of them
  uint64_t seed = 0;         // for R and for the element subset
  int max_reported = 5;      // mismatches listed in the failure message
};

using GradcheckFn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

/// Sets torch's intra-op thread count for a scope. The unit tests run thousands of ops on tiny
/// tensors: a second thread only adds a barrier per op, and on a busy machine (parallel builds)
/// each barrier waits for a scheduler slice (measured: 31 Adam steps of the tiny CapsNet, 16 s on
/// 2 threads under load vs 0.3 s on 1).
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : saved_(at::get_num_threads()) { at::set_num_threads(n); }
  ~ScopedThreads() { at::set_num_threads(saved_); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int saved_;
};

namespace gradcheck_detail {

inline torch::Tensor random_projection(at::IntArrayRef sizes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto r = torch::empty(sizes, torch::kDouble);
  double* p = r.data_ptr<double>();
  for (int64_t k = 0; k < r.numel(); ++k) p[k] = normal(rng);
  return r;
}

// All of [0, numel), or `max` distinct elements of it drawn with `rng` (sorted).
inline std::vector<int64_t> pick_elements(int64_t numel, int64_t max, std::mt19937_64& rng) {
  std::vector<int64_t> all(static_cast<size_t>(numel));
  std::iota(all.begin(), all.end(), int64_t{0});
  if (max <= 0 || numel <= max) return all;
  for (int64_t k = 0; k < max; ++k) {  // partial Fisher-Yates
    std::uniform_int_distribution<int64_t> pick(k, numel - 1);
    std::swap(all[static_cast<size_t>(k)], all[static_cast<size_t>(pick(rng))]);
  }
  all.resize(static_cast<size_t>(max));
  std::sort(all.begin(), all.end());
  return all;
}

inline std::string index_string(at::IntArrayRef sizes, int64_t flat) {
  std::vector<int64_t> idx(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    idx[static_cast<size_t>(d)] = flat % sizes[static_cast<size_t>(d)];
    flat /= sizes[static_cast<size_t>(d)];
  }
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < idx.size(); ++d) os << (d ? ", " : "") << idx[d];
  os << "]";
  return os.str();
}

}  // namespace gradcheck_detail

/// Compares autograd gradients of sum(fn(inputs) * R) with central differences.
/// Every input must be a float64 CPU tensor; those that require grad must be contiguous and are checked.
inline ::testing::AssertionResult gradcheck(const GradcheckFn& fn, const std::vector<torch::Tensor>& inputs,
                                            const GradcheckOptions& options = {}) {
  namespace gd = gradcheck_detail;
  ScopedThreads one_thread(1);  // tiny float64 problems; also keeps every evaluation's summation order fixed
  std::vector<size_t> checked;  // indices into inputs
  std::vector<torch::Tensor> wrt;
  for (size_t n = 0; n < inputs.size(); ++n) {
    const auto& x = inputs[n];
    if (!x.defined()) return ::testing::AssertionFailure() << "gradcheck: input " << n << " is undefined";
    if (x.scalar_type() != torch::kDouble || !x.device().is_cpu())
      return ::testing::AssertionFailure() << "gradcheck: input " << n << " must be a float64 CPU tensor, got "
                                           << x.scalar_type() << " on " << x.device();
    if (!x.requires_grad()) continue;
    if (!x.is_contiguous())
      return ::testing::AssertionFailure() << "gradcheck: input " << n << " must be contiguous";
    checked.push_back(n);
    wrt.push_back(x);
  }
  if (wrt.empty()) return ::testing::AssertionFailure() << "gradcheck: no input requires grad";

  // Analytic gradients.
  auto out = fn(inputs);
  if (!out.defined() || out.scalar_type() != torch::kDouble)
    return ::testing::AssertionFailure() << "gradcheck: the function must return a defined float64 tensor";
  const auto projection = gd::random_projection(out.sizes(), options.seed * 0x9E3779B97F4A7C15ULL + 1);
  auto f = (out * projection).sum();
  if (!f.requires_grad())
    return ::testing::AssertionFailure() << "gradcheck: the output does not depend on any input that requires grad";
  auto grads = torch::autograd::grad({f}, wrt, /*grad_outputs=*/{}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);

  auto evaluate = [&]() {
    torch::NoGradGuard no_grad;
    return (fn(inputs) * projection).sum().item<double>();
  };

  std::mt19937_64 rng(options.seed);
  int64_t mismatches = 0, compared = 0;
  std::ostringstream report;
  report.precision(12);
  for (size_t k = 0; k < wrt.size(); ++k) {
    const auto& x = wrt[k];
    const auto analytic = grads[k].defined() ? grads[k].detach().contiguous() : torch::zeros_like(x.detach());
    const double* a = analytic.data_ptr<double>();
    double* p = x.data_ptr<double>();
    for (const int64_t e : gd::pick_elements(x.numel(), options.max_elements, rng)) {
      const double original = p[e];
      p[e] = original + options.eps;
      const double f_plus = evaluate();
      p[e] = original - options.eps;
      const double f_minus = evaluate();
      p[e] = original;
      const double numeric = (f_plus - f_minus) / (2 * options.eps);
      ++compared;
      const double error = std::abs(a[e] - numeric);
      if (!(error <= options.atol + options.rtol * std::abs(numeric))) {  // NaN fails too
        if (mismatches++ < options.max_reported)
          report << "\n  input " << checked[k] << " element " << gd::index_string(x.sizes(), e) << " (flat " << e
                 << "): analytic " << a[e] << ", numeric " << numeric << ", |diff| " << error;
      }
    }
  }
  if (mismatches > 0) {
    return ::testing::AssertionFailure() << "gradcheck: " << mismatches << " of " << compared
                                         << " gradient elements differ (atol " << options.atol << ", rtol "
                                         << options.rtol << ", eps " << options.eps << "):" << report.str();
  }
  return ::testing::AssertionSuccess() << "gradcheck: " << compared << " elements agree";
}

}  // namespace capsnet::testing
