// EM vote operators (capsnet/ops/em.h) == their composite ATen form, in values and gradients (float32
// and float64, one and two threads, contiguous or not); float64 finite differences; argument errors;
// double backward refused. em_routing with and without them: tests/apps/experiments/test_em.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "gradcheck.h"
#include "capsnet/ops/em.h"
#include "capsnet/ops/routing.h"

namespace {

using capsnet::ops::em_scaled_distance;
using capsnet::ops::em_weighted_moments;

// The slow form: what nn/em_routing.cpp computed before the operators (weights: [B, I, J]).
std::tuple<torch::Tensor, torch::Tensor> composite_moments(const torch::Tensor& w, const torch::Tensor& V) {
  const auto mean = (w.unsqueeze(3) * V).sum(1);                              // [B, J, D]
  const auto var = (w.unsqueeze(3) * (V - mean.unsqueeze(1)).pow(2)).sum(1);  // [B, J, D]
  return {mean, var};
}

torch::Tensor composite_distance(const torch::Tensor& V, const torch::Tensor& mean, const torch::Tensor& var) {
  return ((V - mean.unsqueeze(1)).pow(2) / var.unsqueeze(1)).sum(3);  // [B, I, J]
}

struct Inputs {
  torch::Tensor weights, votes, mean, variance;
};

// Weights as the M-step makes them (positive, each parent's sum over children just under 1) unless
// `free_weights`, where the sums are far from 1 so that every term of the backward matters.
Inputs make_inputs(int64_t B, int64_t I, int64_t J, int64_t D, torch::Dtype dtype, uint64_t seed,
                   bool free_weights = false) {
  torch::manual_seed(seed);
  const auto o = torch::TensorOptions().dtype(dtype);
  Inputs in;
  auto mass = torch::rand({B, I, J}, o) + 0.1;
  in.weights = free_weights ? torch::randn({B, I, J}, o) : mass / (mass.sum(1, true) + 1e-3);
  in.votes = torch::randn({B, I, J, D}, o);
  in.mean = torch::randn({B, J, D}, o);
  in.variance = torch::rand({B, J, D}, o) + 0.2;
  return in;
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(torch::allclose(a, b, rtol, atol)) << what << ": max |diff| " << (a - b).abs().max().item<double>();
}

struct Shape {
  int64_t B, I, J, D;
};
// Tiny, odd, the paper's small model's ConvCaps1 / class capsules (one problem per window or example).
const std::vector<Shape> kShapes{{1, 1, 1, 1}, {3, 5, 2, 3}, {50, 72, 16, 16}, {8, 144, 10, 16}};

// Each test below runs every instruction-set copy of the kernels this CPU has (isa.h).
const std::vector<capsnet::ops::CpuIsa> kIsas{capsnet::ops::CpuIsa::baseline, capsnet::ops::CpuIsa::avx2,
                                              capsnet::ops::CpuIsa::avx512};
const char* isa_name(capsnet::ops::CpuIsa isa) {
  return isa == capsnet::ops::CpuIsa::avx512 ? " avx512" : isa == capsnet::ops::CpuIsa::avx2 ? " avx2" : " baseline";
}
struct IsaScope {
  explicit IsaScope(capsnet::ops::CpuIsa isa) { capsnet::ops::set_cpu_isa(isa); }
  ~IsaScope() { capsnet::ops::set_cpu_isa(capsnet::ops::CpuIsa::automatic); }
};

TEST(EmOps, MomentsAndDistanceEqualTheCompositeForm) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-12 : 2e-5;
    for (const auto& s : kShapes)
      for (int threads : {1, 2})
        for (auto isa : kIsas) {
          IsaScope isa_scope(isa);
          capsnet::testing::ScopedThreads scoped(threads);
          const auto in = make_inputs(s.B, s.I, s.J, s.D, dtype, 7);
          const std::string tag = "B" + std::to_string(s.B) + " I" + std::to_string(s.I) + " J" + std::to_string(s.J) +
                                  " D" + std::to_string(s.D) + " threads " + std::to_string(threads) +
                                  (dtype == torch::kFloat64 ? " f64" : " f32") + isa_name(isa);
          auto [mean, var] = em_weighted_moments(in.weights, in.votes);
          auto [mean_ref, var_ref] = composite_moments(in.weights, in.votes);
          expect_close(mean, mean_ref, tol, tol, "mean " + tag);
          expect_close(var, var_ref, tol, tol, "variance " + tag);
          expect_close(em_scaled_distance(in.votes, in.mean, in.variance),
                       composite_distance(in.votes, in.mean, in.variance), tol, tol, "distance " + tag);
        }
  }
}

TEST(EmOps, NonContiguousInputsGiveTheSameValues) {
  const auto in = make_inputs(4, 6, 3, 5, torch::kFloat64, 3);
  // The same values in memory laid out [B, J, I, D] and [B, D, J] (views transposed back).
  const auto votes_t = in.votes.transpose(1, 2).contiguous().transpose(1, 2);
  const auto weights_t = in.weights.transpose(1, 2).contiguous().transpose(1, 2);
  const auto var_t = in.variance.transpose(1, 2).contiguous().transpose(1, 2);
  ASSERT_FALSE(votes_t.is_contiguous());
  auto [m1, v1] = em_weighted_moments(in.weights, in.votes);
  auto [m2, v2] = em_weighted_moments(weights_t, votes_t);
  EXPECT_TRUE(torch::equal(m1, m2));
  EXPECT_TRUE(torch::equal(v1, v2));
  EXPECT_TRUE(
      torch::equal(em_scaled_distance(in.votes, in.mean, in.variance), em_scaled_distance(votes_t, in.mean, var_t)));
}

TEST(EmOps, GradientsEqualTheCompositeForm) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-11 : 1e-4;
    for (const auto& s : kShapes)
      for (bool free_weights : {false, true})
        for (auto isa : kIsas) {
          IsaScope isa_scope(isa);
          capsnet::testing::ScopedThreads scoped(2);
          const std::string tag = "B" + std::to_string(s.B) + " I" + std::to_string(s.I) +
                                  (free_weights ? " free weights" : " M-step weights") +
                                  (dtype == torch::kFloat64 ? " f64" : " f32") + isa_name(isa);
          auto in = make_inputs(s.B, s.I, s.J, s.D, dtype, 11, free_weights);
          torch::manual_seed(5);
          const auto gm = torch::randn({s.B, s.J, s.D}, in.votes.options());
          const auto gv = torch::randn({s.B, s.J, s.D}, in.votes.options());
          const auto gd = torch::randn({s.B, s.I, s.J}, in.votes.options());
          auto grads = [&](bool fused) {
            auto w = in.weights.clone().requires_grad_(), V = in.votes.clone().requires_grad_();
            auto mu = in.mean.clone().requires_grad_(), var = in.variance.clone().requires_grad_();
            auto [m, v] = fused ? em_weighted_moments(w, V) : composite_moments(w, V);
            auto d = fused ? em_scaled_distance(V, mu, var) : composite_distance(V, mu, var);
            ((m * gm).sum() + (v * gv).sum() + (d * gd).sum()).backward();
            return std::vector<torch::Tensor>{w.grad(), V.grad(), mu.grad(), var.grad()};
          };
          const auto fast = grads(true), slow = grads(false);
          const char* names[] = {"weights", "votes", "mean", "variance"};
          // Relative to the gradient's largest entry: free weights make sums of both signs (cancellation).
          for (size_t k = 0; k < fast.size(); ++k) {
            const double scale = std::max(1.0, slow[k].abs().max().item<double>());
            expect_close(fast[k], slow[k], tol * scale, tol, std::string("grad ") + names[k] + " " + tag);
          }
        }
  }
}

TEST(EmOps, GradcheckFloat64) {
  for (bool free_weights : {false, true}) {
    auto in = make_inputs(2, 4, 3, 2, torch::kFloat64, 21, free_weights);
    in.weights.requires_grad_();
    in.votes.requires_grad_();
    in.mean.requires_grad_();
    in.variance.requires_grad_();
    auto moments = [](const std::vector<torch::Tensor>& x) {
      auto [m, v] = em_weighted_moments(x[0], x[1]);
      return torch::cat({m.flatten(), 0.7 * v.flatten()});
    };
    EXPECT_TRUE(capsnet::testing::gradcheck(moments, {in.weights, in.votes})) << "free " << free_weights;
    auto distance = [](const std::vector<torch::Tensor>& x) { return em_scaled_distance(x[0], x[1], x[2]); };
    EXPECT_TRUE(capsnet::testing::gradcheck(distance, {in.votes, in.mean, in.variance}));
  }
}

TEST(EmOps, AnOutputLeftUnusedCountsAsAZeroGradient) {
  auto in = make_inputs(3, 4, 2, 3, torch::kFloat64, 2);
  for (int used : {0, 1}) {
    auto V1 = in.votes.clone().requires_grad_(), V2 = in.votes.clone().requires_grad_();
    auto out1 = em_weighted_moments(in.weights, V1);
    auto out2 = composite_moments(in.weights, V2);
    (used ? std::get<1>(out1) : std::get<0>(out1)).sum().backward();
    (used ? std::get<1>(out2) : std::get<0>(out2)).sum().backward();
    expect_close(V1.grad(), V2.grad(), 1e-12, 1e-12, "output " + std::to_string(used) + " alone");
  }
}

TEST(EmOps, DoubleBackwardIsRefused) {
  auto in = make_inputs(2, 3, 2, 2, torch::kFloat64, 4);
  auto V = in.votes.clone().requires_grad_();
  auto d = em_scaled_distance(V, in.mean, in.variance).sum();
  auto g = torch::autograd::grad({d}, {V}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  EXPECT_THROW(g.sum().backward(), c10::Error);
  auto [m, v] = em_weighted_moments(in.weights, V);
  auto g2 = torch::autograd::grad({v.sum()}, {V}, {}, true, true)[0];
  EXPECT_THROW(g2.sum().backward(), c10::Error);
}

void expect_error_mentions(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(EmOps, BadInputThrowsNamingTheArgument) {
  const auto in = make_inputs(2, 3, 4, 5, torch::kFloat32, 1);
  expect_error_mentions([&] { em_weighted_moments(in.weights, in.votes.flatten(2)); }, "votes must be [B, I, J, D]");
  expect_error_mentions([&] { em_weighted_moments(in.weights.slice(2, 0, 3), in.votes); }, "weights must be");
  expect_error_mentions([&] { em_weighted_moments(in.weights.to(torch::kFloat64), in.votes); }, "dtype of votes");
  expect_error_mentions([&] { em_weighted_moments(in.weights, in.votes.to(torch::kInt32)); },
                        "votes must be float32 or float64");
  expect_error_mentions([&] { em_weighted_moments(in.weights, in.votes.to(torch::kBFloat16)); },
                        "votes must be float32 or float64");
  expect_error_mentions([&] { em_scaled_distance(in.votes, in.mean.slice(1, 0, 2), in.variance); }, "mean must be");
  expect_error_mentions([&] { em_scaled_distance(in.votes, in.mean, in.variance.to(torch::kFloat64)); },
                        "variance must have the dtype of votes");
  expect_error_mentions([&] { em_scaled_distance(in.votes, in.mean, torch::Tensor()); }, "variance must be a defined");
  // Without autograd the CPU kernels check the same things.
  torch::NoGradGuard no_grad;
  expect_error_mentions([&] { em_scaled_distance(in.votes.flatten(0, 1), in.mean, in.variance); },
                        "capsnet::em_scaled_distance: votes must be");
}

}  // namespace
