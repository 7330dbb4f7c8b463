// Fused routing operators (capsnet/ops) == the oracle capsnet::detail::reference_routing, in values and
// gradients, both gradient modes; float64 finite differences; argument errors.
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "capsnet/nn/functional.h"
#include "capsnet/ops/routing.h"

namespace {

static_assert(capsnet::ops::kSquashEps == capsnet::kNormEps, "the fused op must squash like capsnet::squash");

// These tests run thousands of ATen ops on tiny tensors: with 2 intra-op threads on a busy machine every
// op waits for a barrier (measured 50x slower under load). One thread for all of them, except where a
// test sets its own count (SameResultWithOneOrTwoThreads covers the multi-threaded kernels).
class OneThreadEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    saved_ = at::get_num_threads();
    at::set_num_threads(1);
  }
  void TearDown() override { at::set_num_threads(saved_); }

 private:
  int saved_ = 1;
};
[[maybe_unused]] ::testing::Environment* const kOneThread =
    ::testing::AddGlobalTestEnvironment(new OneThreadEnvironment);

struct Shape {
  int64_t B, I, J, D, Din;
};

std::string name(const Shape& s, int64_t r, bool full) {
  std::ostringstream os;
  os << "B=" << s.B << " I=" << s.I << " J=" << s.J << " D=" << s.D << " Din=" << s.Din << " r=" << r
     << (full ? " full gradient" : " c_ij constant");
  return os.str();
}

// Includes I = 1, J = 1, B = 1, Din != D, B > the per-example kernel's example block (8) and not a
// multiple of it, I > its child block (16) and not a multiple of it, and B = 37: several example-lane
// blocks (16 float32 or 8 float64 lanes with AVX-512, fewer below) with a partly filled last one.
const std::vector<Shape> kShapes = {
    {1, 1, 1, 1, 1}, {2, 5, 3, 4, 2},    {3, 7, 1, 6, 5},  {1, 1, 4, 3, 2},  {4, 9, 5, 2, 3},
    {5, 3, 2, 8, 8}, {2, 12, 10, 16, 8}, {11, 6, 3, 4, 7}, {3, 37, 4, 5, 3}, {37, 5, 3, 4, 3},
};
const std::vector<int64_t> kIterations = {1, 2, 3, 5};

// max |a - b| / max(max |b|, 1e-6): error relative to the scale of the expected tensor.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.to(torch::kDouble), b64 = b.to(torch::kDouble);
  if (b64.numel() == 0) return 0.0;
  const double scale = std::max(b64.abs().max().item<double>(), 1e-6);
  return (a64 - b64).abs().max().item<double>() / scale;
}

// u_hat_{j|i} = W_ij u_i by explicit einsum. u: [B, I, Din], W: [I, J, D, Din] -> [B, I, J, D].
torch::Tensor predictions(const torch::Tensor& u, const torch::Tensor& W) {
  return torch::einsum("bik,ijdk->bijd", {u, W});
}

capsnet::RoutingOptions routing(int64_t r, bool full) {
  capsnet::RoutingOptions o;
  o.iterations = r;
  o.grad_through_routing = full;
  return o;
}

struct Result {
  torch::Tensor v, grad_u, grad_W;
};

// v and the gradients of sum(v * R) w.r.t. u and W for `fn` on fresh leaves copied from u0, W0.
Result run(const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& fn, const torch::Tensor& u0,
           const torch::Tensor& W0, const torch::Tensor& R) {
  auto u = u0.detach().clone().set_requires_grad(true);
  auto W = W0.detach().clone().set_requires_grad(true);
  auto v = fn(u, W);
  auto grads = torch::autograd::grad({(v * R).sum()}, {u, W}, {}, false, false, /*allow_unused=*/true);
  return {v.detach(), grads[0].defined() ? grads[0] : torch::zeros_like(u0),
          grads[1].defined() ? grads[1] : torch::zeros_like(W0)};
}

// Inputs with non-trivial routing: |u_hat| ~ 1, so the coupling coefficients move away from 1/J.
void make_inputs(const Shape& s, torch::ScalarType dtype, torch::Tensor& u, torch::Tensor& W, torch::Tensor& R) {
  u = torch::randn({s.B, s.I, s.Din}, torch::kDouble).to(dtype);
  W = (torch::randn({s.I, s.J, s.D, s.Din}, torch::kDouble) / std::sqrt(double(s.Din))).to(dtype);
  R = torch::randn({s.B, s.J, s.D}, torch::kDouble).to(dtype);
}

// Forces a CPU kernel copy for the scope (ops::set_cpu_isa / set_cpu_kernel), restores the default after.
struct ScopedCpuKernel {
  ScopedCpuKernel(capsnet::ops::CpuIsa isa, capsnet::ops::CpuKernel kernel) {
    capsnet::ops::set_cpu_isa(isa);
    capsnet::ops::set_cpu_kernel(kernel);
  }
  ~ScopedCpuKernel() {
    capsnet::ops::set_cpu_isa(capsnet::ops::CpuIsa::automatic);
    capsnet::ops::set_cpu_kernel(capsnet::ops::CpuKernel::automatic);
  }
};

// Tolerance of the fused op against the float64 oracle (relative to the scale of the expected tensor).
// float32: with |u_hat| ~ 1 and r = 5 the full gradient is ill-conditioned; there ATen's own float32
// evaluation of the oracle is off by up to 3.7e-5 (measured over 100 random cases), the fused op by 3.3e-5.
double tolerance(torch::ScalarType dtype, int64_t r) {
  if (dtype == torch::kDouble) return 1e-10;
  return r <= 3 ? 1e-5 : 1e-4;
}

// The oracle always runs in float64 (on the same, possibly float32-rounded, inputs).
void expect_fused_matches_reference(torch::ScalarType dtype) {
  torch::manual_seed(1);
  for (const auto& s : kShapes) {
    for (const int64_t r : kIterations) {
      for (const bool full : {true, false}) {
        torch::Tensor u, W, R;
        make_inputs(s, dtype, u, W, R);
        const auto fused = run(
            [&](const auto& u_, const auto& W_) { return capsnet::ops::capsule_routing(u_, W_, r, full); }, u, W, R);
        const auto ref = run(
            [&](const auto& u_, const auto& W_) {
              return capsnet::detail::reference_routing(predictions(u_, W_), routing(r, full));
            },
            u.to(torch::kDouble), W.to(torch::kDouble), R.to(torch::kDouble));
        const double tol = tolerance(dtype, r);
        ASSERT_EQ(fused.v.sizes(), ref.v.sizes()) << name(s, r, full);
        ASSERT_EQ(fused.v.scalar_type(), dtype);
        ASSERT_EQ(fused.grad_u.scalar_type(), dtype);
        ASSERT_EQ(fused.grad_W.scalar_type(), dtype);
        EXPECT_LE(relative_error(fused.v, ref.v), tol) << "v, " << name(s, r, full);
        EXPECT_LE(relative_error(fused.grad_u, ref.grad_u), tol) << "grad u, " << name(s, r, full);
        EXPECT_LE(relative_error(fused.grad_W, ref.grad_W), tol) << "grad W, " << name(s, r, full);
      }
    }
  }
}

TEST(FusedRouting, MatchesReferenceFloat64) { expect_fused_matches_reference(torch::kDouble); }

TEST(FusedRouting, MatchesReferenceFloat32) { expect_fused_matches_reference(torch::kFloat); }

void expect_predictions_match_reference(torch::ScalarType dtype) {
  torch::manual_seed(2);
  for (const auto& s : kShapes) {
    for (const int64_t r : kIterations) {
      for (const bool full : {true, false}) {
        torch::Tensor u, W, R;
        make_inputs(s, dtype, u, W, R);
        const auto u_hat0 = predictions(u, W);
        auto run_pred = [&](const std::function<torch::Tensor(const torch::Tensor&)>& fn, torch::ScalarType type) {
          auto u_hat = u_hat0.detach().to(type).clone().set_requires_grad(true);
          auto v = fn(u_hat);
          auto g = torch::autograd::grad({(v * R.to(type)).sum()}, {u_hat})[0];
          return std::make_pair(v.detach(), g);
        };
        const auto fused =
            run_pred([&](const auto& x) { return capsnet::ops::routing_from_predictions(x, r, full); }, dtype);
        const auto ref = run_pred(
            [&](const auto& x) { return capsnet::detail::reference_routing(x, routing(r, full)); }, torch::kDouble);
        EXPECT_EQ(fused.second.scalar_type(), dtype);
        EXPECT_LE(relative_error(fused.first, ref.first), tolerance(dtype, r)) << "v, " << name(s, r, full);
        EXPECT_LE(relative_error(fused.second, ref.second), tolerance(dtype, r)) << "grad u_hat, " << name(s, r, full);
      }
    }
  }
}

TEST(RoutingFromPredictions, MatchesReferenceFloat64) { expect_predictions_match_reference(torch::kDouble); }

TEST(RoutingFromPredictions, MatchesReferenceFloat32) { expect_predictions_match_reference(torch::kFloat); }

// The fused op's CPU kernels exist per instruction set (baseline, AVX2+FMA, AVX-512: the widest the CPU
// has by default; a cap above it runs the widest it has) and in two layouts (per example, example lanes:
// chosen by batch size). The tests above ran the default choice; this one forces every combination
// against the same oracle, float64 and float32.
TEST(FusedRouting, EveryInstructionSetAndKernelLayoutMatchesReference) {
  using capsnet::ops::CpuIsa;
  using capsnet::ops::CpuKernel;
  for (const CpuIsa isa : {CpuIsa::baseline, CpuIsa::avx2, CpuIsa::avx512}) {
    for (const CpuKernel kernel : {CpuKernel::per_example, CpuKernel::example_lanes}) {
      SCOPED_TRACE("isa " + std::to_string(int(isa)) + ", kernel " + std::to_string(int(kernel)));
      ScopedCpuKernel forced(isa, kernel);
      expect_fused_matches_reference(torch::kDouble);
      expect_fused_matches_reference(torch::kFloat);
    }
  }
  ScopedCpuKernel baseline(CpuIsa::baseline, CpuKernel::automatic);
  expect_predictions_match_reference(torch::kDouble);
}

// ------------------------------------------------------------------------------------------------
// Central-difference gradient check (float64): the autograd gradient of sum(fn(x) * R) against central
// differences of sum(value_fn(x) * R), for every element of every input. value_fn = fn checks fn's own
// derivative; see FiniteDifferenceGradientsFloat64 for the stop-gradient mode.
using Fn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

::testing::AssertionResult finite_difference_check(const Fn& fn, const Fn& value_fn, std::vector<torch::Tensor> inputs,
                                                   double eps = 1e-6, double atol = 1e-8, double rtol = 1e-6) {
  for (auto& x : inputs) x = x.detach().clone().contiguous().set_requires_grad(true);
  auto out = fn(inputs);
  const auto R = torch::randn(out.sizes(), torch::kDouble);
  const auto analytic = torch::autograd::grad({(out * R).sum()}, inputs);
  torch::NoGradGuard no_grad;
  std::ostringstream failures;
  int64_t bad = 0, checked = 0;
  for (size_t n = 0; n < inputs.size(); ++n) {
    auto flat = inputs[n].view({-1});
    auto a = analytic[n].reshape({-1});
    for (int64_t e = 0; e < flat.numel(); ++e) {
      const double x0 = flat[e].item<double>();
      flat[e] = x0 + eps;
      const double f_plus = (value_fn(inputs) * R).sum().item<double>();
      flat[e] = x0 - eps;
      const double f_minus = (value_fn(inputs) * R).sum().item<double>();
      flat[e] = x0;
      const double numeric = (f_plus - f_minus) / (2 * eps), got = a[e].item<double>();
      ++checked;
      if (!(std::abs(got - numeric) <= atol + rtol * std::abs(numeric)) && bad++ < 5)
        failures << "\n  input " << n << " element " << e << ": analytic " << got << ", numeric " << numeric;
    }
  }
  if (bad) return ::testing::AssertionFailure() << bad << " of " << checked << " gradients differ:" << failures.str();
  return ::testing::AssertionSuccess();
}

// c^(r-1) of Procedure 1 at u_hat0: softmax_j(u_hat . A), A = sum_{t<r-1} v^(t), [B, I, J]
// (the oracle run for t + 1 iterations returns v^(t)).
torch::Tensor frozen_coupling(const torch::Tensor& u_hat0, int64_t r) {
  torch::NoGradGuard no_grad;
  auto A = torch::zeros({u_hat0.size(0), u_hat0.size(2), u_hat0.size(3)}, u_hat0.options());
  for (int64_t t = 0; t + 1 < r; ++t) A += capsnet::detail::reference_routing(u_hat0, routing(t + 1, true));
  return torch::softmax((u_hat0 * A.unsqueeze(1)).sum(-1), 2);
}

TEST(FusedRouting, FiniteDifferenceGradientsFloat64) {
  // Full gradient: the op's gradient is the derivative of its value. Stop-gradient mode: by design it is
  // not (c_ij are constants); it is the derivative of G(x) = squash(sum_i c_ij(x0) u_hat_ij(x)) with c
  // frozen at the checked point x0, so the central differences are taken of G.
  torch::manual_seed(3);
  for (const auto kernel : {capsnet::ops::CpuKernel::per_example, capsnet::ops::CpuKernel::example_lanes}) {
    ScopedCpuKernel forced(capsnet::ops::CpuIsa::automatic, kernel);
    for (const Shape s : {Shape{2, 3, 2, 3, 2}, Shape{1, 4, 3, 2, 3}, Shape{3, 1, 1, 2, 1}}) {
      for (const int64_t r : {1, 2, 3}) {
        for (const bool full : {true, false}) {
          torch::Tensor u, W, R;
          make_inputs(s, torch::kDouble, u, W, R);
          const auto c0 = frozen_coupling(predictions(u, W), r).unsqueeze(-1);  // [B, I, J, 1]
          const Fn fused = [&](const auto& x) { return capsnet::ops::capsule_routing(x[0], x[1], r, full); };
          const Fn fused_frozen = [&](const auto& x) { return capsnet::squash((c0 * predictions(x[0], x[1])).sum(1)); };
          EXPECT_TRUE(finite_difference_check(fused, full ? fused : fused_frozen, {u, W})) << name(s, r, full);
          const Fn pred = [&](const auto& x) { return capsnet::ops::routing_from_predictions(x[0], r, full); };
          const Fn pred_frozen = [&](const auto& x) { return capsnet::squash((c0 * x[0]).sum(1)); };
          EXPECT_TRUE(finite_difference_check(pred, full ? pred : pred_frozen, {predictions(u, W)}))
              << "from predictions, " << name(s, r, full);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------

TEST(FusedRouting, NonContiguousInputs) {
  torch::manual_seed(4);
  const auto u_base = torch::randn({3, 5, 8}, torch::kDouble);
  const auto W_base = torch::randn({5, 6, 2, 8}, torch::kDouble) / 2;
  const auto R = torch::randn({3, 6, 2}, torch::kDouble);
  // The op sees strided views u: [3, 5, 4] and W: [5, 6, 2, 4]; gradients flow back to the bases.
  auto narrowed = [](const auto& fn) {
    return [fn](const torch::Tensor& u, const torch::Tensor& W) {
      const auto u_view = u.narrow(2, 0, 4), W_view = W.narrow(3, 0, 4);
      EXPECT_FALSE(u_view.is_contiguous());
      EXPECT_FALSE(W_view.is_contiguous());
      return fn(u_view, W_view);
    };
  };
  for (const bool full : {true, false}) {
    const auto fused = run(narrowed([&](const torch::Tensor& u, const torch::Tensor& W) {
                             return capsnet::ops::capsule_routing(u, W, 3, full);
                           }),
                           u_base, W_base, R);
    const auto ref = run(narrowed([&](const torch::Tensor& u, const torch::Tensor& W) {
                           return capsnet::detail::reference_routing(predictions(u, W), routing(3, full));
                         }),
                         u_base, W_base, R);
    EXPECT_LE(relative_error(fused.v, ref.v), 1e-10);
    EXPECT_LE(relative_error(fused.grad_u, ref.grad_u), 1e-10);
    EXPECT_LE(relative_error(fused.grad_W, ref.grad_W), 1e-10);
  }
  // Predictions in the strided layout CapsuleLinear produces ([B, I, J, D] view of [I, J*D, B]).
  const auto u_hat = torch::randn({5, 6 * 2, 3}, torch::kDouble).permute({2, 0, 1}).view({3, 5, 6, 2});
  ASSERT_FALSE(u_hat.is_contiguous());
  EXPECT_LE(relative_error(capsnet::ops::routing_from_predictions(u_hat, 2, false),
                           capsnet::detail::reference_routing(u_hat, routing(2, false))),
            1e-12);
}

TEST(FusedRouting, ZeroInputGivesZeroOutputAndFiniteGradients) {
  auto u = torch::zeros({2, 4, 3}, torch::kDouble).set_requires_grad(true);
  auto W = torch::randn({4, 3, 5, 3}, torch::kDouble).set_requires_grad(true);
  auto v = capsnet::ops::capsule_routing(u, W, 3, true);
  EXPECT_EQ(v.abs().max().item<double>(), 0.0);
  (v * torch::randn_like(v)).sum().backward();
  EXPECT_TRUE(torch::isfinite(u.grad()).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(W.grad()).all().item<bool>());
}

TEST(FusedRouting, EmptyBatch) {
  auto v = capsnet::ops::capsule_routing(torch::zeros({0, 4, 3}), torch::randn({4, 3, 5, 3}), 3, true);
  EXPECT_EQ(v.sizes(), (std::vector<int64_t>{0, 3, 5}));
}

TEST(FusedRouting, SameResultWithOneOrTwoThreads) {
  // Every example's arithmetic is independent of how the batch (forward) or the children (dW) are split,
  // so 2 threads give bit-identical results to 1 (and match the oracle).
  torch::manual_seed(5);
  torch::Tensor u, W, R;
  make_inputs({24, 70, 10, 16, 8}, torch::kFloat, u, W, R);
  const int saved = at::get_num_threads();
  auto once = [&](int threads) {
    at::set_num_threads(threads);
    return run([](const auto& u_, const auto& W_) { return capsnet::ops::capsule_routing(u_, W_, 3, true); }, u, W, R);
  };
  const auto one = once(1), two = once(2);
  const auto ref =
      run([](const auto& u_,
             const auto& W_) { return capsnet::detail::reference_routing(predictions(u_, W_), routing(3, true)); },
          u, W, R);
  at::set_num_threads(saved);
  EXPECT_LE(relative_error(two.v, ref.v), 1e-5);
  EXPECT_LE(relative_error(two.grad_u, ref.grad_u), 1e-5);
  EXPECT_LE(relative_error(two.grad_W, ref.grad_W), 1e-5);
  EXPECT_TRUE(torch::equal(one.v, two.v));
  EXPECT_TRUE(torch::equal(one.grad_u, two.grad_u));
  EXPECT_TRUE(torch::equal(one.grad_W, two.grad_W));
}

TEST(FusedRouting, AnExamplesOutputDoesNotDependOnTheBatchItIsRoutedIn) {
  // The default (example-lane) kernels give every example the same operations in the same order in any
  // lane of any vector width, so routing it alone, in a batch of 3 or in a batch of 37 (several blocks,
  // other lane positions) gives bit-identical outputs; `capsnet predict --batch-size` relies on it.
  torch::manual_seed(7);
  torch::Tensor u, W, R;
  make_inputs({37, 70, 10, 16, 8}, torch::kFloat, u, W, R);
  torch::NoGradGuard no_grad;
  const auto all = capsnet::ops::capsule_routing(u, W, 3, true);
  for (const int64_t b : {0, 1, 5, 17, 36}) {
    EXPECT_TRUE(torch::equal(capsnet::ops::capsule_routing(u.slice(0, b, b + 1), W, 3, true), all.slice(0, b, b + 1)))
        << "example " << b << " alone";
    const int64_t first = std::min<int64_t>(b, 34);
    EXPECT_TRUE(torch::equal(capsnet::ops::capsule_routing(u.slice(0, first, first + 3), W, 3, true),
                             all.slice(0, first, first + 3)))
        << "examples " << first << ".." << first + 2;
  }
}

TEST(FusedRouting, PredictionCacheGivesBitIdenticalOutputsAndGradients) {
  // Small batches keep iteration 1's predictions for the later iterations (ops::set_prediction_cache_bytes)
  // instead of recomputing them: the same values, so v and both gradients must not change in any bit,
  // for one block, several blocks, every instruction set and r = 1 (nothing to keep) to 3.
  torch::manual_seed(11);
  struct Restore {
    ~Restore() { capsnet::ops::set_prediction_cache_bytes(-1); }
  } restore;
  for (const auto isa : {capsnet::ops::CpuIsa::automatic, capsnet::ops::CpuIsa::avx2, capsnet::ops::CpuIsa::baseline}) {
    ScopedCpuKernel kernel(isa, capsnet::ops::CpuKernel::example_lanes);
    for (const Shape s : {Shape{1, 70, 10, 16, 8}, Shape{5, 33, 4, 6, 3}, Shape{37, 70, 10, 16, 8}}) {
      for (const int64_t r : {1, 2, 3}) {
        torch::Tensor u, W, R;
        make_inputs(s, torch::kFloat, u, W, R);
        auto routed = [&](int64_t cache_bytes) {
          capsnet::ops::set_prediction_cache_bytes(cache_bytes);
          return run([&](const auto& u_, const auto& W_) { return capsnet::ops::capsule_routing(u_, W_, r, true); }, u,
                     W, R);
        };
        const auto off = routed(0), on = routed(int64_t{1} << 40), by_default = routed(-1);
        for (const auto* x : {&on, &by_default}) {
          EXPECT_TRUE(torch::equal(x->v, off.v)) << "B " << s.B << " r " << r;
          EXPECT_TRUE(torch::equal(x->grad_u, off.grad_u)) << "B " << s.B << " r " << r;
          EXPECT_TRUE(torch::equal(x->grad_W, off.grad_W)) << "B " << s.B << " r " << r;
        }
        // And the cached forward is still the routing: against the float64 oracle.
        const auto ref = run(
            [&](const auto& u_, const auto& W_) {
              return capsnet::detail::reference_routing(predictions(u_, W_), routing(r, true));
            },
            u.to(torch::kDouble), W.to(torch::kDouble), R.to(torch::kDouble));
        EXPECT_LE(relative_error(on.v, ref.v), 1e-5) << "B " << s.B << " r " << r;
        EXPECT_LE(relative_error(on.grad_W, ref.grad_W), 1e-5) << "B " << s.B << " r " << r;
      }
    }
  }
}

TEST(FusedRouting, NoGradAndDispatcherPathsAgree) {
  torch::manual_seed(6);
  torch::Tensor u, W, R;
  make_inputs({3, 5, 4, 6, 2}, torch::kDouble, u, W, R);
  const auto expected = capsnet::ops::capsule_routing(u, W, 3, true);
  {
    torch::NoGradGuard no_grad;  // still through the Autograd kernel, which records nothing
    EXPECT_TRUE(torch::equal(capsnet::ops::capsule_routing(u, W, 3, true), expected));
  }
  {
    c10::InferenceMode inference;  // skips Autograd: the CPU kernel of the public op directly
    EXPECT_TRUE(torch::equal(capsnet::ops::capsule_routing(u, W, 3, false), expected));
  }
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("capsnet::capsule_routing", "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  auto uu = u.clone().set_requires_grad(true);
  auto v = op.call(uu, W, 3, true);
  ASSERT_TRUE(v.requires_grad());
  EXPECT_TRUE(torch::equal(v.detach(), expected));
}

TEST(FusedRouting, DoubleBackwardIsAClearError) {
  auto u = torch::randn({2, 3, 2}, torch::kDouble).set_requires_grad(true);
  auto W = torch::randn({3, 2, 2, 2}, torch::kDouble).set_requires_grad(true);
  auto v = capsnet::ops::capsule_routing(u, W, 2, true);
  auto g = torch::autograd::grad({v.sum()}, {u}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  try {
    torch::autograd::grad({g.sum()}, {W});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("double backward"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------------------------------------

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected a c10::Error mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(needle), std::string::npos) << "message: " << message.substr(0, 300);
    EXPECT_NE(message.find("capsnet::"), std::string::npos) << "message: " << message.substr(0, 300);
  }
}

TEST(FusedRouting, BadArgumentsGiveClearErrors) {
  const auto u = torch::randn({2, 5, 3});
  const auto W = torch::randn({5, 4, 6, 3});
  using capsnet::ops::capsule_routing;
  expect_error([&] { capsule_routing(u.flatten(1), W, 3, true); }, "u must be [B, I, Din]");
  expect_error([&] { capsule_routing(u, W.flatten(2), 3, true); }, "W must be [I, J, D, Din]");
  expect_error(
      [&] {
        capsule_routing(u, torch::randn({6, 4, 6, 3}), 3, true);
      },
      "I = 5 input capsules but W has I = 6");
  expect_error([&] { capsule_routing(u, torch::randn({5, 4, 6, 2}), 3, true); }, "Din = 3 but W has Din = 2");
  expect_error([&] { capsule_routing(u.to(torch::kLong), W, 3, true); }, "u must be float32 or float64");
  expect_error([&] { capsule_routing(u, W.to(torch::kInt), 3, true); }, "W must be float32 or float64");
  expect_error([&] { capsule_routing(u.to(torch::kHalf), W.to(torch::kHalf), 3, true); }, "float32 or float64");
  expect_error([&] { capsule_routing(u, W.to(torch::kDouble), 3, true); }, "same dtype");
  expect_error([&] { capsule_routing(u, W, 0, true); }, "iterations must be >= 1");
  expect_error([&] { capsule_routing(u, W, -2, false); }, "iterations must be >= 1");
  {
    c10::InferenceMode inference;  // the CPU kernel checks too
    expect_error([&] { capsule_routing(u, torch::randn({6, 4, 6, 3}), 3, true); }, "input capsules");
    expect_error([&] { capsule_routing(u, W, 0, true); }, "iterations must be >= 1");
  }
  using capsnet::ops::routing_from_predictions;
  expect_error([&] { routing_from_predictions(torch::randn({2, 5, 4}), 3, true); }, "u_hat must be [B, I, J, D]");
  expect_error(
      [&] {
        routing_from_predictions(torch::ones({2, 5, 4, 3}, torch::kLong), 3, true);
      },
      "u_hat must be float32 or float64");
  expect_error([&] { routing_from_predictions(torch::randn({2, 5, 4, 3}), 0, true); }, "iterations must be >= 1");
}

}  // namespace
