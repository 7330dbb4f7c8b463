// Dynamic routing (Procedure 1 of Sabour et al. 2017): the batched implementation and the
// reference implementation against a plain nested-loop transcription of the procedure.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "capsnet/nn/functional.h"
#include "gradcheck.h"

namespace {

using capsnet::testing::gradcheck;

// Thousands of tiny ops per test: one thread (see ScopedThreads).
class RoutingTest : public ::testing::Test {
  capsnet::testing::ScopedThreads one_thread_{1};
};

struct LoopResult {
  torch::Tensor v;  // [B, J, D] after the last iteration
  torch::Tensor c;  // [B, I, J] coupling coefficients used in the last iteration
};

// Procedure 1, literally: explicit logits b_ij, scalar loops over b, i, j, d in double.
LoopResult loop_routing(const torch::Tensor& u_hat_in, int64_t iterations) {
  const auto u_hat = u_hat_in.detach().to(torch::kDouble).contiguous();
  const auto u = u_hat.accessor<double, 4>();  // [B, I, J, D]
  const int64_t B = u_hat.size(0), I = u_hat.size(1), J = u_hat.size(2), D = u_hat.size(3);
  auto logits = torch::zeros({B, I, J}, torch::kDouble);  // b_ij <- 0
  auto c_t = torch::zeros({B, I, J}, torch::kDouble);
  auto s_t = torch::zeros({B, J, D}, torch::kDouble);
  auto v_t = torch::zeros({B, J, D}, torch::kDouble);
  auto b = logits.accessor<double, 3>();
  auto c = c_t.accessor<double, 3>();
  auto s = s_t.accessor<double, 3>();
  auto v = v_t.accessor<double, 3>();
  for (int64_t t = 0; t < iterations; ++t) {
    for (int64_t n = 0; n < B; ++n) {
      // c_i <- softmax_j(b_i)
      for (int64_t i = 0; i < I; ++i) {
        double max_b = b[n][i][0];
        for (int64_t j = 1; j < J; ++j) max_b = std::max(max_b, b[n][i][j]);
        double z = 0;
        for (int64_t j = 0; j < J; ++j) z += std::exp(b[n][i][j] - max_b);
        for (int64_t j = 0; j < J; ++j) c[n][i][j] = std::exp(b[n][i][j] - max_b) / z;
      }
      // s_j <- sum_i c_ij u_hat_{j|i}
      for (int64_t j = 0; j < J; ++j)
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t i = 0; i < I; ++i) acc += c[n][i][j] * u[n][i][j][d];
          s[n][j][d] = acc;
        }
      // v_j <- squash(s_j), with the library's epsilon inside the norm
      for (int64_t j = 0; j < J; ++j) {
        double sq = 0;
        for (int64_t d = 0; d < D; ++d) sq += s[n][j][d] * s[n][j][d];
        const double scale = sq / (1 + sq) / std::sqrt(sq + capsnet::kNormEps);
        for (int64_t d = 0; d < D; ++d) v[n][j][d] = scale * s[n][j][d];
      }
      // b_ij <- b_ij + u_hat_{j|i} . v_j, except after the last iteration
      if (t + 1 < iterations)
        for (int64_t i = 0; i < I; ++i)
          for (int64_t j = 0; j < J; ++j) {
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += u[n][i][j][d] * v[n][j][d];
            b[n][i][j] += dot;
          }
    }
  }
  return {v_t, c_t};
}

capsnet::RoutingOptions routing(int64_t iterations, bool grad_through_routing = true) {
  capsnet::RoutingOptions o;
  o.iterations = iterations;
  o.grad_through_routing = grad_through_routing;
  return o;
}

struct Shape {
  int64_t B, I, J, D;
};
const std::vector<Shape> kShapes = {{1, 1, 1, 1}, {2, 5, 1, 4},  {3, 1, 4, 2},
                                    {2, 7, 3, 5}, {4, 32, 10, 16}, {2, 1152, 10, 16}};
const std::vector<int64_t> kIterations = {1, 2, 3, 5};

// Prediction vectors with a spread of lengths (some capsules agree strongly, some barely).
torch::Tensor random_u_hat(const Shape& s, uint64_t seed, torch::ScalarType dtype = torch::kDouble) {
  torch::manual_seed(seed);
  auto scale = torch::rand({s.B, s.I, s.J, 1}, torch::kDouble) * 2 / std::sqrt(static_cast<double>(s.I));
  return (torch::randn({s.B, s.I, s.J, s.D}, torch::kDouble) * scale + 0.05).to(dtype);
}

std::string describe(const Shape& s, int64_t r) {
  return "B=" + std::to_string(s.B) + " I=" + std::to_string(s.I) + " J=" + std::to_string(s.J) +
         " D=" + std::to_string(s.D) + " r=" + std::to_string(r);
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

TEST_F(RoutingTest, LoopOracleSanity) {
  // One child, one parent: c = 1, v = squash(u_hat), whatever r.
  auto u = torch::tensor({3.0, 4.0}, torch::kDouble).view({1, 1, 1, 2});
  for (int64_t r : kIterations) {
    auto out = loop_routing(u, r);
    EXPECT_NEAR(out.v[0][0][0].item<double>(), 25.0 / 26.0 * 0.6, 1e-8);
    EXPECT_NEAR(out.v[0][0][1].item<double>(), 25.0 / 26.0 * 0.8, 1e-8);
    EXPECT_DOUBLE_EQ(out.c[0][0][0].item<double>(), 1.0);
  }
  // Routing concentrates coupling on the parent that agrees: child 0 predicts the same vector as
  // child 1 for parent 0, and something orthogonal for parent 1 where child 2 disagrees.
  // u2[0][i][j] = prediction of child i for parent j
  auto u2 = torch::tensor({1.0, 0.0, 0.0, 1.0,      // child 0: +x for parent 0, +y for parent 1
                           1.0, 0.0, 0.0, -1.0,     // child 1: +x, -y
                           -1.0, 0.0, 0.0, -1.0},   // child 2: -x, -y
                          torch::kDouble)
                .view({1, 3, 2, 2});
  auto c = loop_routing(u2, 3).c;
  EXPECT_GT(c[0][0][0].item<double>(), 0.5);  // child 0 agrees with parent 0 (v_0 ~ +x)
  EXPECT_LT(c[0][0][1].item<double>(), 0.5);  // and disagrees with parent 1 (v_1 ~ -y)
  EXPECT_TRUE(torch::allclose(c.sum(2), torch::ones({1, 3}, torch::kDouble), 0, 1e-14));
}

TEST_F(RoutingTest, ReferenceEqualsLoopFloat64) {
  uint64_t seed = 100;
  for (const auto& shape : kShapes)
    for (int64_t r : kIterations) {
      auto u = random_u_hat(shape, seed++);
      auto expected = loop_routing(u, r).v;
      auto ref = capsnet::detail::reference_routing(u, routing(r));
      ASSERT_EQ(ref.sizes(), (std::vector<int64_t>{shape.B, shape.J, shape.D}));
      EXPECT_EQ(ref.scalar_type(), torch::kDouble);
      EXPECT_LT(max_abs_diff(ref, expected), 1e-12) << describe(shape, r);
      // The stop-gradient mode computes the same values.
      auto ref_sg = capsnet::detail::reference_routing(u, routing(r, false));
      EXPECT_LT(max_abs_diff(ref_sg, expected), 1e-12) << describe(shape, r);
    }
}

TEST_F(RoutingTest, DynamicRoutingEqualsReferenceFloat64) {
  uint64_t seed = 200;
  for (const auto& shape : kShapes)
    for (int64_t r : kIterations) {
      auto u = random_u_hat(shape, seed++);
      for (bool grad_through : {true, false}) {
        auto ref = capsnet::detail::reference_routing(u, routing(r, grad_through));
        auto fast = capsnet::dynamic_routing(u, routing(r, grad_through));
        ASSERT_EQ(fast.sizes(), ref.sizes());
        EXPECT_EQ(fast.scalar_type(), torch::kDouble);
        EXPECT_LT(max_abs_diff(fast, ref), 1e-12) << describe(shape, r) << " grad_through " << grad_through;
        EXPECT_LT(max_abs_diff(fast, loop_routing(u, r).v), 1e-12) << describe(shape, r);
      }
    }
}

TEST_F(RoutingTest, Float32MatchesFloat64Loop) {
  uint64_t seed = 300;
  for (const auto& shape : kShapes)
    for (int64_t r : kIterations) {
      auto u = random_u_hat(shape, seed++, torch::kFloat);
      auto expected = loop_routing(u, r).v;  // same (float32-rounded) inputs, float64 arithmetic
      auto fast = capsnet::dynamic_routing(u, routing(r));
      auto ref = capsnet::detail::reference_routing(u, routing(r));
      EXPECT_EQ(fast.scalar_type(), torch::kFloat);
      EXPECT_EQ(ref.scalar_type(), torch::kFloat);
      EXPECT_LT(max_abs_diff(fast, expected), 1e-5) << describe(shape, r);
      EXPECT_LT(max_abs_diff(ref, expected), 1e-5) << describe(shape, r);
    }
}

TEST_F(RoutingTest, NonContiguousInput) {
  // u_hat as produced by CapsuleLinear is a strided view; results must not depend on layout.
  auto base = random_u_hat({2, 6, 3, 4}, 350);
  auto strided = base.permute({0, 2, 1, 3}).contiguous().permute({0, 2, 1, 3});
  ASSERT_FALSE(strided.is_contiguous());
  auto expected = loop_routing(base, 3).v;
  EXPECT_LT(max_abs_diff(capsnet::dynamic_routing(strided, routing(3)), expected), 1e-12);
  EXPECT_LT(max_abs_diff(capsnet::detail::reference_routing(strided, routing(3)), expected), 1e-12);
}

TEST_F(RoutingTest, RoutingIsPerExample) {
  // Routing one example alone gives the same v as routing it inside a batch (no logits shared
  // across the batch, unlike some published code).
  auto u = random_u_hat({3, 9, 4, 5}, 400);
  auto batch = capsnet::dynamic_routing(u, routing(3));
  for (int64_t n = 0; n < 3; ++n) {
    auto alone = capsnet::dynamic_routing(u.slice(0, n, n + 1), routing(3));
    EXPECT_LT(max_abs_diff(alone[0], batch[n]), 1e-12) << "example " << n;
  }
}

TEST_F(RoutingTest, OneIterationGivesUniformCoupling) {
  auto u = random_u_hat({2, 6, 4, 3}, 500);
  auto loop = loop_routing(u, 1);
  EXPECT_TRUE(torch::allclose(loop.c, torch::full({2, 6, 4}, 0.25, torch::kDouble), 0, 1e-15));
  // v_j = squash(sum_i u_hat_{j|i} / J)
  auto expected = capsnet::squash(u.sum(1) / 4.0);
  EXPECT_LT(max_abs_diff(capsnet::dynamic_routing(u, routing(1)), expected), 1e-14);
  EXPECT_LT(max_abs_diff(capsnet::detail::reference_routing(u, routing(1)), expected), 1e-14);
  // With more iterations the coupling is no longer uniform, so the output differs.
  EXPECT_GT(max_abs_diff(capsnet::dynamic_routing(u, routing(3)), expected), 1e-6);
}

// Gradient of sum(routing(u) * R) with respect to u.
torch::Tensor routing_grad(bool fast, const torch::Tensor& u, const torch::Tensor& R,
                           const capsnet::RoutingOptions& o) {
  auto x = u.detach().clone().set_requires_grad(true);
  auto v = fast ? capsnet::dynamic_routing(x, o) : capsnet::detail::reference_routing(x, o);
  (v * R).sum().backward();
  return x.grad();
}

TEST_F(RoutingTest, DynamicRoutingGradientEqualsReference) {
  uint64_t seed = 600;
  for (const auto& shape : kShapes) {
    if (shape.I > 100) continue;  // the large shape adds nothing here
    for (int64_t r : kIterations)
      for (bool grad_through : {true, false}) {
        auto u = random_u_hat(shape, seed++);
        auto R = torch::randn({shape.B, shape.J, shape.D}, torch::kDouble);
        auto g_ref = routing_grad(false, u, R, routing(r, grad_through));
        auto g_fast = routing_grad(true, u, R, routing(r, grad_through));
        ASSERT_TRUE(g_ref.defined() && g_fast.defined());
        EXPECT_LT(max_abs_diff(g_fast, g_ref), 1e-11)
            << describe(shape, r) << " grad_through " << grad_through;
      }
  }
  // float32 gradients agree with float64 ones.
  auto u = random_u_hat({2, 32, 10, 16}, 650);
  auto R = torch::randn({2, 10, 16}, torch::kDouble);
  for (bool grad_through : {true, false}) {
    auto g64 = routing_grad(false, u, R, routing(3, grad_through));
    auto g32 = routing_grad(true, u.to(torch::kFloat), R.to(torch::kFloat), routing(3, grad_through));
    EXPECT_LT(max_abs_diff(g32, g64), 1e-5) << "grad_through " << grad_through;
  }
}

TEST_F(RoutingTest, GradcheckBothImplementationsBothModes) {
  // Full gradient: the true derivative of v(u_hat), checked against central differences.
  // Stop-gradient: by design *not* the derivative of v(u_hat) once r > 1 (the coupling moves with
  // u_hat), but the derivative of h(x) = squash(sum_i c_ij x_{j|i}) with c frozen at the point of
  // evaluation. It is checked with a straight-through function whose value is h (differenced
  // numerically) and whose autograd gradient is the routing's.
  uint64_t seed = 700;
  for (const Shape& shape : {Shape{2, 3, 2, 3}, Shape{1, 4, 3, 2}})
    for (int64_t r : {1, 3})
      for (bool fast : {true, false}) {
        auto u = random_u_hat(shape, seed++).mul(3).set_requires_grad(true);
        auto route = [fast](const torch::Tensor& x, const capsnet::RoutingOptions& o) {
          return fast ? capsnet::dynamic_routing(x, o) : capsnet::detail::reference_routing(x, o);
        };
        const std::string what = std::string(fast ? "dynamic_routing " : "reference_routing ") + describe(shape, r);
        EXPECT_TRUE(gradcheck([&](const auto& in) { return route(in[0], routing(r, true)); }, {u}))
            << what << " full gradient";

        const auto c = loop_routing(u, r).c.unsqueeze(-1);  // [B, I, J, 1], frozen at u
        auto straight_through = [&](const std::vector<torch::Tensor>& in) {
          auto v = route(in[0], routing(r, false));
          auto h = capsnet::squash((c * in[0]).sum(1));
          return h.detach() + (v - v.detach());
        };
        EXPECT_TRUE(gradcheck(straight_through, {u})) << what << " stop-gradient";
        // And the checker sees that the stop-gradient mode is not the full derivative (r > 1).
        auto plain = gradcheck([&](const auto& in) { return route(in[0], routing(r, false)); }, {u});
        if (r > 1)
          EXPECT_FALSE(plain) << what;
        else
          EXPECT_TRUE(plain) << what;  // one iteration: c = 1/J is constant anyway
      }
}

TEST_F(RoutingTest, StopGradientTreatsCouplingAsConstant) {
  // grad_through_routing = false: dv/du_hat is that of v_j = squash(sum_i c_ij u_hat_{j|i}) with c
  // the (constant) coupling coefficients of the last iteration.
  uint64_t seed = 800;
  for (const Shape& shape : {Shape{2, 5, 3, 4}, Shape{3, 8, 10, 6}})
    for (int64_t r : {1, 2, 3, 5}) {
      auto u = random_u_hat(shape, seed++).mul(2);
      auto R = torch::randn({shape.B, shape.J, shape.D}, torch::kDouble);
      auto c = loop_routing(u, r).c;  // [B, I, J], detached
      auto x = u.clone().set_requires_grad(true);
      (capsnet::squash((c.unsqueeze(-1) * x).sum(1)) * R).sum().backward();
      auto expected = x.grad();
      for (bool fast : {true, false}) {
        auto g = routing_grad(fast, u, R, routing(r, false));
        EXPECT_LT(max_abs_diff(g, expected), 1e-12) << describe(shape, r) << (fast ? " fast" : " reference");
        // The full gradient differs once the coupling depends on u_hat (r > 1).
        auto g_full = routing_grad(fast, u, R, routing(r, true));
        if (r > 1)
          EXPECT_GT(max_abs_diff(g_full, expected), 1e-6) << describe(shape, r);
        else
          EXPECT_LT(max_abs_diff(g_full, expected), 1e-12) << describe(shape, r);
      }
    }
}

TEST_F(RoutingTest, BadInputThrows) {
  auto good = torch::randn({2, 3, 4, 5});
  for (bool fast : {true, false}) {
    auto call = [&](const torch::Tensor& u, int64_t r) {
      return fast ? capsnet::dynamic_routing(u, routing(r)) : capsnet::detail::reference_routing(u, routing(r));
    };
    EXPECT_NO_THROW(call(good, 3));
    EXPECT_THROW(call(torch::randn({2, 3, 4}), 3), c10::Error);            // 3-D
    EXPECT_THROW(call(torch::randn({2, 3, 4, 5, 1}), 3), c10::Error);      // 5-D
    EXPECT_THROW(call(torch::ones({2, 3, 4, 5}, torch::kInt), 3), c10::Error);   // integer
    EXPECT_THROW(call(torch::ones({2, 3, 4, 5}, torch::kLong), 3), c10::Error);  // integer
    EXPECT_THROW(call(good, 0), std::invalid_argument);                     // no iteration
    EXPECT_THROW(call(good, -2), std::invalid_argument);
  }
  EXPECT_THROW(capsnet::detail::check_routing_args(torch::randn({2, 3, 4}), routing(3)), c10::Error);
  // The message names the problem.
  try {
    capsnet::dynamic_routing(good, routing(0));
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("iterations"), std::string::npos) << e.what();
  }
}

}  // namespace
