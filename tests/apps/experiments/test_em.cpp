// Matrix capsules with EM routing: em_routing vs the loop reference (values, gradients), float64
// gradchecks, routing properties, spread loss by hand, layer shapes and votes, bad input, CLI end to end.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "capsnet/models/matrix_capsnet.h"
#include "capsnet/nn/em_routing.h"
#include "capsnet/nn/matrix_caps.h"
#include "capsnet/train/checkpoint.h"
#include "apps/experiments/em.h"
#include "gradcheck.h"
#include "cli_helpers.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace capsnet {
namespace {

using testing::ScopedThreads;

struct RoutingInputs {
  torch::Tensor votes, a, beta_u, beta_a;
  std::vector<torch::Tensor> all() const { return {votes, a, beta_u, beta_a}; }
};

// Votes with a little structure (two clusters) so that routing has something to separate.
RoutingInputs make_inputs(int64_t B, int64_t I, int64_t J, int64_t D, uint64_t seed, bool requires_grad) {
  torch::manual_seed(seed);
  auto o = torch::TensorOptions().dtype(torch::kDouble);
  RoutingInputs in;
  in.votes = (0.5 * torch::randn({B, I, J, D}, o) + torch::randn({1, 1, J, D}, o)).contiguous();
  in.a = (0.1 + 0.8 * torch::rand({B, I}, o)).contiguous();
  in.beta_u = (0.7 + 0.3 * torch::randn({J}, o)).contiguous();  // beta_u + log sigma near 0: no saturation
  in.beta_a = (0.3 * torch::randn({J}, o)).contiguous();
  if (requires_grad)
    for (auto* t : {&in.votes, &in.a, &in.beta_u, &in.beta_a}) t->requires_grad_(true);
  return in;
}

using testing::tiny_em_config;

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double tol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double diff = (a - b).abs().max().item<double>();
  EXPECT_LE(diff, tol) << what << ": max |diff| " << diff;
}

TEST(EmRouting, FastMatchesReferenceValuesAndGradientsFloat64) {
  ScopedThreads one(1);
  struct Case {
    bool normalize, outside;
    std::vector<double> lambdas;
    const char* tag;
  };
  const std::vector<Case> cases = {
      {false, false, inverse_temperature_schedule(3, 0.5, 2.0), "paper cost, lambda 0.5->2, offset inside"},
      {true, false, inverse_temperature_schedule(3, 0.5, 2.0), "normalized cost, lambda 0.5->2, offset inside"},
      {false, true, inverse_temperature_schedule(3, 0.5, 2.0), "paper cost, lambda 0.5->2, offset outside"},
      {false, true, paper_inverse_temperature_schedule(3, 5.0), "paper cost, paper schedule x5, offset outside"},
      {true, true, {}, "normalized cost, default (paper) schedule, offset outside"},
  };
  for (const auto& c : cases) {
    EmRoutingOptions opt;
    opt.iterations = 3;
    opt.inverse_temperature = c.lambdas;
    opt.normalize_cost = c.normalize;
    opt.logit_offset_outside_lambda = c.outside;
    auto in = make_inputs(2, 5, 3, 4, 7, true);
    auto fast = em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
    auto ref = detail::reference_em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
    const std::string tag = c.tag;
    expect_close(fast.poses, ref.poses, 1e-10, tag + " poses");
    expect_close(fast.activations, ref.activations, 1e-10, tag + " activations");

    auto Rp = torch::randn_like(fast.poses), Ra = torch::randn_like(fast.activations);
    auto grads_of = [&](const EmRoutingResult& r) {
      return torch::autograd::grad({(r.poses * Rp).sum() + (r.activations * Ra).sum()}, in.all());
    };
    auto gf = grads_of(fast), gr = grads_of(ref);
    const char* names[] = {"votes", "activations_in", "beta_u", "beta_a"};
    for (size_t k = 0; k < gf.size(); ++k) {
      EXPECT_GT(gr[k].abs().max().item<double>(), 1e-6) << tag << " gradient of " << names[k] << " is zero";
      expect_close(gf[k], gr[k], 1e-9, tag + " gradient of " + names[k]);
    }
  }
}

// The fused vote passes (ops/em.h, the default for float CPU votes) against the composite ATen form
// they replace: the same poses, activations and gradients, with the default E-step normalisation and
// with a child_log_total hook, in float64 and at the paper's small ConvCaps1 size in float32.
TEST(EmRouting, FusedVotePassesEqualTheCompositeForm) {
  ScopedThreads two(2);
  struct Case {
    int64_t B, I, J, D;
    torch::Dtype dtype;
    double tol;
  };
  for (const auto& c : {Case{3, 6, 4, 16, torch::kDouble, 1e-11}, Case{50, 72, 16, 16, torch::kFloat, 2e-4}})
    for (bool hook : {false, true}) {
      auto in = make_inputs(c.B, c.I, c.J, c.D, 13, false);
      auto votes = in.votes.to(c.dtype).requires_grad_(), a = in.a.to(c.dtype).requires_grad_();
      auto bu = in.beta_u.to(c.dtype).requires_grad_(), ba = in.beta_a.to(c.dtype).requires_grad_();
      EmRoutingOptions opt;
      opt.normalize_cost = true;
      opt.inverse_temperature = paper_inverse_temperature_schedule(3, 1.0);
      opt.variance_eps = 0.1;
      // A hook that couples the problems (children shared by pairs of problems, as overlapping
      // windows share them), so that R differs from the per-problem softmax.
      if (hook)
        opt.child_log_total = [](const torch::Tensor& lw) {
          auto per_problem = torch::logsumexp(lw, 2, true);  // [B, I, 1]
          return torch::logaddexp(per_problem, per_problem.roll(1, 0));
        };
      const std::string tag = std::string(c.dtype == torch::kDouble ? "f64" : "f32 small-model size") +
                              (hook ? ", coupled problems" : ", per problem");
      torch::manual_seed(3);
      const auto Rp = torch::randn({c.B, c.J, c.D}, votes.options()), Ra = torch::randn({c.B, c.J}, votes.options());
      auto run = [&](bool fused) {
        opt.fused_vote_passes = fused;
        auto r = em_routing(votes, a, bu, ba, opt);
        auto g = torch::autograd::grad({(r.poses * Rp).sum() + (r.activations * Ra).sum()}, {votes, a, bu, ba});
        g.insert(g.begin(), {r.poses.detach(), r.activations.detach()});
        return g;
      };
      const auto fast = run(true), slow = run(false);
      const char* names[] = {"poses", "activations", "grad votes", "grad activations_in", "grad beta_u", "grad beta_a"};
      for (size_t k = 0; k < fast.size(); ++k) {
        const double scale = std::max(1.0, slow[k].abs().max().item<double>());
        expect_close(fast[k], slow[k], c.tol * scale, tag + " " + names[k]);
      }
    }
}

TEST(EmRouting, ScalarBetasEqualConstantPerParentBetas) {
  ScopedThreads one(1);
  auto in = make_inputs(2, 4, 3, 4, 3, false);
  auto bu = torch::full({1}, 0.2, torch::kDouble), ba = torch::full({}, -0.1, torch::kDouble);
  auto a = em_routing(in.votes, in.a, bu, ba);
  auto b = em_routing(in.votes, in.a, bu.expand({3}).contiguous(), ba.expand({3}).contiguous());
  expect_close(a.poses, b.poses, 0, "poses");
  expect_close(a.activations, b.activations, 0, "activations");
}

TEST(EmRouting, GradcheckFloat64) {
  auto in = make_inputs(1, 4, 2, 3, 11, true);
  EmRoutingOptions opt;
  opt.iterations = 3;
  opt.inverse_temperature = {1.0, 1.5, 2.0};
  auto fn = [&](const std::vector<torch::Tensor>& x) {
    auto r = em_routing(x[0], x[1], x[2], x[3], opt);
    return torch::cat({r.poses.flatten(), r.activations.flatten()});
  };
  opt.logit_offset_outside_lambda = false;
  EXPECT_TRUE(testing::gradcheck(fn, in.all()));
  opt.normalize_cost = true;
  EXPECT_TRUE(testing::gradcheck(fn, in.all()));
  opt.logit_offset_outside_lambda = true;
  EXPECT_TRUE(testing::gradcheck(fn, in.all()));
  opt.inverse_temperature = {};  // the default: the paper's schedule
  EXPECT_TRUE(testing::gradcheck(fn, in.all()));
}

TEST(EmRouting, StandardizedCostMatchesReferenceAndGradcheck) {
  // standardize_cost (not in the paper): the fast path == the loop reference in values and gradients
  // (float64), for both logit-offset forms and both cost scalings, and finite differences agree.
  ScopedThreads one(1);
  for (const bool outside : {true, false})
    for (const bool normalize : {true, false}) {
      EmRoutingOptions opt;
      opt.standardize_cost = true;
      opt.inverse_temperature = {1.0, 2.0, 3.0};
      opt.logit_offset_outside_lambda = outside;
      opt.normalize_cost = normalize;
      const std::string tag = fmt::format("offset {}, {} cost", outside ? "outside" : "inside",
                                          normalize ? "normalised" : "paper");
      auto in = make_inputs(2, 5, 3, 4, 17, true);
      auto fast = em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
      auto ref = detail::reference_em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
      expect_close(fast.poses, ref.poses, 1e-10, tag + " poses");
      expect_close(fast.activations, ref.activations, 1e-10, tag + " activations");
      auto Rp = torch::randn_like(fast.poses), Ra = torch::randn_like(fast.activations);
      auto gf = torch::autograd::grad({(fast.poses * Rp).sum() + (fast.activations * Ra).sum()}, in.all());
      auto gr = torch::autograd::grad({(ref.poses * Rp).sum() + (ref.activations * Ra).sum()}, in.all());
      const char* names[] = {"votes", "activations_in", "beta_u", "beta_a"};
      for (size_t k = 0; k < gf.size(); ++k) {
        EXPECT_GT(gr[k].abs().max().item<double>(), 1e-6) << tag << " gradient of " << names[k] << " is zero";
        expect_close(gf[k], gr[k], 1e-9, tag + " gradient of " + names[k]);
      }
      auto small = make_inputs(1, 4, 3, 3, 19, true);
      auto fn = [&](const std::vector<torch::Tensor>& x) {
        auto r = em_routing(x[0], x[1], x[2], x[3], opt);
        return torch::cat({r.poses.flatten(), r.activations.flatten()});
      };
      EXPECT_TRUE(testing::gradcheck(fn, small.all())) << tag;
    }
}

TEST(EmRouting, StandardizedCostsHaveZeroMeanAndUnitVarianceOverParents) {
  // With the offset outside lambda, c_j = (beta_a_j - logit(a_j)) / lambda is the standardised cost:
  // over the J parents of each problem its mean is 0 and its mean square 1, whatever the scale of the
  // votes (x1 and x100: the logits' spread does not grow with the pose scale). Without it the paper's
  // cost scales with log sigma. J = 1: c = 0, so a = logistic(beta_a).
  ScopedThreads one(1);
  EmRoutingOptions opt;
  opt.standardize_cost = true;
  opt.inverse_temperature = {1.0, 1.0, 2.0};
  auto in = make_inputs(3, 9, 5, 16, 23, false);
  for (const double scale : {1.0, 100.0}) {
    auto r = em_routing(scale * in.votes, in.a, in.beta_u, in.beta_a, opt);
    auto c = (in.beta_a.view({1, 5}) - torch::logit(r.activations)) / 2.0;  // [B, J]
    expect_close(c.mean(1), torch::zeros({3}, torch::kDouble), 1e-9, fmt::format("mean, scale {}", scale));
    expect_close(c.pow(2).mean(1), torch::ones({3}, torch::kDouble), 1e-5, fmt::format("mean square, scale {}", scale));
  }
  auto one_parent = make_inputs(2, 6, 1, 4, 29, false);
  auto r = em_routing(one_parent.votes, one_parent.a, one_parent.beta_u, one_parent.beta_a, opt);
  expect_close(r.activations, torch::sigmoid(one_parent.beta_a).expand({2, 1}), 1e-12, "J = 1");
  opt.cost_std_eps = 0;
  EXPECT_THROW(em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt), std::invalid_argument);
}

TEST(EmRouting, ActivationsInOpenUnitIntervalAndFinite) {
  ScopedThreads one(1);
  auto in = make_inputs(3, 12, 5, 16, 5, false);
  // float32 rounds the logistic of a logit above ~17 to exactly 1: [0, 1] there, (0, 1) in float64
  // with a small inverse temperature (lambda scales the logit).
  auto r32 = em_routing(in.votes.to(torch::kFloat), in.a.to(torch::kFloat), in.beta_u.to(torch::kFloat),
                        in.beta_a.to(torch::kFloat));
  EXPECT_TRUE(torch::isfinite(r32.poses).all().item<bool>());
  EXPECT_GE(r32.activations.min().item<float>(), 0.0f);
  EXPECT_LE(r32.activations.max().item<float>(), 1.0f);
  EmRoutingOptions opt;
  opt.inverse_temperature = {0.05, 0.05, 0.05};
  auto r = em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
  EXPECT_EQ(r.poses.sizes(), (std::vector<int64_t>{3, 5, 16}));
  EXPECT_EQ(r.activations.sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_TRUE(torch::isfinite(r.poses).all().item<bool>());
  EXPECT_GT(r.activations.min().item<double>(), 0.0);
  EXPECT_LT(r.activations.max().item<double>(), 1.0);
}

TEST(EmRouting, OneParentGetsEveryChildWithCouplingOne) {
  // With J = 1 the E-step gives R_i1 = 1, so mu is the a-weighted mean of the votes after any number
  // of iterations, and sigma^2 their a-weighted variance (checked through the activation, with the
  // default options: the paper's lambda schedule, logit offset outside lambda).
  ScopedThreads one(1);
  auto in = make_inputs(2, 6, 1, 4, 9, false);
  for (int64_t iters : {1, 3}) {
    EmRoutingOptions opt;
    opt.iterations = iters;
    const double lambda = 0.01 * (1 - std::pow(0.95, double(iters)));  // lambda of the last iteration
    auto r = em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
    auto w = in.a.unsqueeze(2).unsqueeze(3);                       // [B, I, 1, 1]
    auto mu = (w * in.votes).sum(1) / (w.sum(1) + opt.mass_eps);   // [B, 1, D]
    auto var = (w * (in.votes - mu.unsqueeze(1)).pow(2)).sum(1) / (w.sum(1) + opt.mass_eps) + opt.variance_eps;
    auto mass = in.a.sum(1, true);                                 // [B, 1]
    auto cost = ((in.beta_u.view({1, 1, 1}) + 0.5 * var.log()) * mass.unsqueeze(2)).sum(2);
    auto act = torch::sigmoid(in.beta_a.view({1, 1}) - lambda * cost);
    expect_close(r.poses, mu, 1e-12, "poses");
    expect_close(r.activations, act, 1e-12, "activations");
  }
}

TEST(EmRouting, PaperScheduleIsTheDefault) {
  // lambda_t = 0.01 (1 - 0.95^(t+1)), t = 0, 1, 2 (the authors' answer to the ICLR reviews).
  const auto l = paper_inverse_temperature_schedule(3);
  ASSERT_EQ(l.size(), 3u);
  EXPECT_NEAR(l[0], 0.0005, 1e-15);
  EXPECT_NEAR(l[1], 0.000975, 1e-15);
  EXPECT_NEAR(l[2], 0.00142625, 1e-15);
  EXPECT_NEAR(paper_inverse_temperature_schedule(1, 2.0)[0], 0.1, 1e-15);
  ScopedThreads one(1);
  auto in = make_inputs(2, 5, 3, 4, 8, false);
  EmRoutingOptions defaults, explicit_paper;
  explicit_paper.inverse_temperature = l;
  explicit_paper.logit_offset_outside_lambda = true;
  EXPECT_TRUE(defaults.logit_offset_outside_lambda);
  EXPECT_FALSE(defaults.child_log_total);
  auto a = em_routing(in.votes, in.a, in.beta_u, in.beta_a, defaults);
  auto b = em_routing(in.votes, in.a, in.beta_u, in.beta_a, explicit_paper);
  expect_close(a.poses, b.poses, 0, "poses");
  expect_close(a.activations, b.activations, 0, "activations");
}

TEST(EmRouting, LogitOffsetOutsideLambdaGivesBetaAItsOwnScale) {
  // J = 1 (R = 1): a = logistic(beta_a - lambda cost) outside, logistic(lambda (beta_a - cost)) inside.
  // d a / d beta_a = a (1 - a) outside, lambda a (1 - a) inside: with lambda ~ 1e-3 Adam's normalised
  // steps on beta_a hardly move a (the issue's "beta_a barely moves").
  ScopedThreads one(1);
  auto in = make_inputs(1, 6, 1, 4, 10, false);
  const double lambda = 0.002;
  for (const bool outside : {true, false}) {
    EmRoutingOptions opt;
    opt.iterations = 1;
    opt.inverse_temperature = {lambda};
    opt.logit_offset_outside_lambda = outside;
    auto beta_a = in.beta_a.clone().requires_grad_(true);
    auto r = em_routing(in.votes, in.a, in.beta_u, beta_a, opt);
    auto w = in.a.unsqueeze(2).unsqueeze(3);
    auto mu = (w * in.votes).sum(1) / (w.sum(1) + opt.mass_eps);
    auto var = (w * (in.votes - mu.unsqueeze(1)).pow(2)).sum(1) / (w.sum(1) + opt.mass_eps) + opt.variance_eps;
    auto cost = ((in.beta_u.view({1, 1, 1}) + 0.5 * var.log()) * in.a.sum(1, true).unsqueeze(2)).sum(2);  // [1, 1]
    auto logit = outside ? in.beta_a.view({1, 1}) - lambda * cost : lambda * (in.beta_a.view({1, 1}) - cost);
    expect_close(r.activations, torch::sigmoid(logit), 1e-12, outside ? "outside" : "inside");
    r.activations.sum().backward();
    const double a = r.activations.item<double>();
    EXPECT_NEAR(beta_a.grad().item<double>(), (outside ? 1.0 : lambda) * a * (1 - a), 1e-12);
  }
}

TEST(EmRouting, ChildLogTotalHookWithLogsumexpEqualsTheDefault) {
  // The hook's contract: logsumexp over j is exactly the per-problem normalisation.
  ScopedThreads one(1);
  auto in = make_inputs(2, 5, 3, 4, 12, true);
  EmRoutingOptions plain, hooked;
  hooked.child_log_total = [](const torch::Tensor& log_weights) { return log_weights.logsumexp(2, true); };
  plain.inverse_temperature = hooked.inverse_temperature = {0.5, 1.0, 1.5};
  auto a = em_routing(in.votes, in.a, in.beta_u, in.beta_a, plain);
  auto b = em_routing(in.votes, in.a, in.beta_u, in.beta_a, hooked);
  expect_close(a.poses, b.poses, 1e-12, "poses");
  expect_close(a.activations, b.activations, 1e-12, "activations");
  auto ga = torch::autograd::grad({a.poses.sum() + a.activations.sum()}, in.all());
  auto gb = torch::autograd::grad({b.poses.sum() + b.activations.sum()}, in.all());
  for (size_t k = 0; k < ga.size(); ++k) expect_close(ga[k], gb[k], 1e-10, "gradient " + std::to_string(k));
}

TEST(EmRouting, IdenticalVotesGiveZeroVarianceWithoutNan) {
  ScopedThreads one(1);
  auto vote = torch::randn({1, 1, 2, 16});
  auto votes = vote.expand({2, 8, 2, 16}).contiguous().requires_grad_(true);  // every child votes the same
  auto a = torch::full({2, 8}, 0.7).requires_grad_(true);
  auto bu = torch::zeros({2}, torch::requires_grad()), ba = torch::zeros({2}, torch::requires_grad());
  auto r = em_routing(votes, a, bu, ba);
  ASSERT_TRUE(torch::isfinite(r.poses).all().item<bool>());
  ASSERT_TRUE(torch::isfinite(r.activations).all().item<bool>());
  expect_close(r.poses, vote.view({1, 2, 16}).expand({2, 2, 16}), 1e-5, "mu = the common vote");
  // sigma^2 = variance_eps: log sigma = 0.5 log 1e-4 < 0, so cost < 0 and every parent is active.
  EXPECT_GT(r.activations.min().item<double>(), 0.5);
  (r.poses.sum() + r.activations.sum()).backward();
  for (const auto& g : {votes.grad(), a.grad(), bu.grad(), ba.grad()})
    EXPECT_TRUE(torch::isfinite(g).all().item<bool>());
}

TEST(EmRouting, RoutingSeparatesTwoClusters) {
  // Children 0-3 vote (near) x for parent 0 and garbage for parent 1; children 4-7 the opposite with y.
  // After routing each parent's mean must sit on its cluster, not on the average of all votes.
  ScopedThreads one(1);
  torch::manual_seed(2);
  auto o = torch::kDouble;
  auto x = torch::randn({16}, o), y = torch::randn({16}, o) + 3;
  auto votes = torch::randn({1, 8, 2, 16}, o) * 3;
  for (int i = 0; i < 4; ++i) votes[0][i][0] = x + 0.01 * torch::randn({16}, o);
  for (int i = 4; i < 8; ++i) votes[0][i][1] = y + 0.01 * torch::randn({16}, o);
  auto r = em_routing(votes, torch::ones({1, 8}, o), torch::zeros({2}, o), torch::zeros({2}, o));
  EXPECT_LT((r.poses[0][0] - x).abs().max().item<double>(), 0.05);
  EXPECT_LT((r.poses[0][1] - y).abs().max().item<double>(), 0.05);
}

TEST(EmRouting, BadInputThrowsNamingTheArgument) {
  auto in = make_inputs(2, 4, 3, 4, 1, false);
  auto expect_throw = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no exception; expected one naming " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_throw([&] { em_routing(in.votes[0], in.a, in.beta_u, in.beta_a); }, "votes");
  expect_throw([&] { em_routing(in.votes, in.a.narrow(1, 0, 3), in.beta_u, in.beta_a); }, "activations_in");
  expect_throw([&] { em_routing(in.votes, in.a, torch::zeros({2}, torch::kDouble), in.beta_a); }, "beta_u");
  expect_throw([&] { em_routing(in.votes, in.a, in.beta_u, torch::zeros({4}, torch::kDouble)); }, "beta_a");
  expect_throw([&] { em_routing(in.votes, in.a.to(torch::kFloat), in.beta_u, in.beta_a); }, "activations_in");
  expect_throw([&] { em_routing(in.votes.to(torch::kLong), in.a, in.beta_u, in.beta_a); }, "votes");
  EmRoutingOptions bad;
  bad.iterations = 0;
  expect_throw([&] { em_routing(in.votes, in.a, in.beta_u, in.beta_a, bad); }, "iterations");
  bad.iterations = 3;
  bad.inverse_temperature = {1.0, 2.0};
  expect_throw([&] { em_routing(in.votes, in.a, in.beta_u, in.beta_a, bad); }, "inverse_temperature");
  expect_throw([&] { inverse_temperature_schedule(0, 1, 1); }, "iterations");
  expect_throw([&] { paper_inverse_temperature_schedule(0); }, "iterations");
  expect_throw([&] { paper_inverse_temperature_schedule(3, 0.0); }, "base");
  EmRoutingOptions with_normaliser;
  with_normaliser.child_log_total = [](const torch::Tensor& x) { return x.logsumexp(2, true); };
  expect_throw([&] { detail::reference_em_routing(in.votes, in.a, in.beta_u, in.beta_a, with_normaliser); },
               "child_log_total");
  expect_throw([&] { spread_loss(torch::rand({2, 3}), torch::tensor({0, 3}, torch::kLong), 0.5); }, "labels");
  expect_throw([&] { spread_loss(torch::rand({2}), torch::tensor({0, 1}, torch::kLong), 0.5); }, "activations");
  expect_throw([&] { spread_loss(torch::rand({2, 3}), torch::tensor({0, 1}, torch::kLong), -0.1); }, "margin");
  expect_throw([&] { spread_margin(0, 0); }, "total_steps");
}

TEST(SpreadLoss, MatchesHandComputation) {
  auto a = torch::tensor({0.9, 0.5, 0.1, 0.2, 0.6, 0.3}, torch::kDouble).view({2, 3}).requires_grad_(true);
  auto labels = torch::tensor({0, 2}, torch::kLong);
  // Example 0 (t = 0, m = 0.5): (0.5 - 0.4)^2 + max(0, 0.5 - 0.8)^2 = 0.01.
  // Example 1 (t = 2): (0.5 - (0.3 - 0.2))^2 + (0.5 - (0.3 - 0.6))^2 = 0.16 + 0.64 = 0.8. Mean 0.405.
  auto loss = spread_loss(a, labels, 0.5);
  EXPECT_NEAR(loss.item<double>(), 0.405, 1e-12);
  loss.backward();
  // dL/da_i = 2 (m - a_t + a_i) / B for i != t; dL/da_t = -sum of those.
  auto expected = torch::tensor({-0.1, 0.1, 0.0, 0.4, 0.8, -1.2}, torch::kDouble).view({2, 3});
  expect_close(a.grad(), expected, 1e-12, "gradient");
  // The margin schedule: 0.2 at the first step, 0.9 at the last, linear in between.
  EXPECT_DOUBLE_EQ(spread_margin(0, 8), 0.2);
  EXPECT_DOUBLE_EQ(spread_margin(7, 8), 0.9);
  EXPECT_NEAR(spread_margin(3, 8), 0.2 + 0.7 * 3 / 7.0, 1e-12);
  EXPECT_DOUBLE_EQ(spread_margin(100, 8), 0.9);
  EXPECT_DOUBLE_EQ(spread_margin(0, 1), 0.9);
  // Zero when the target wins every comparison by the margin.
  EXPECT_EQ(spread_loss(torch::tensor({{0.95, 0.0, 0.05}}), torch::tensor({0}, torch::kLong), 0.9).item<float>(), 0.0f);
}

TEST(MatrixCaps, LayerShapes) {
  ScopedThreads one(1);
  torch::manual_seed(0);
  nn::PrimaryMatrixCaps primary(nn::PrimaryMatrixCapsOptions(3, 4));
  auto caps = primary->forward(torch::randn({2, 3, 7, 7}));
  EXPECT_EQ(caps.poses.sizes(), (std::vector<int64_t>{2, 7, 7, 4, 16}));
  EXPECT_EQ(caps.activations.sizes(), (std::vector<int64_t>{2, 7, 7, 4}));
  EXPECT_GT(caps.activations.min().item<float>(), 0.0f);
  EXPECT_LT(caps.activations.max().item<float>(), 1.0f);
  nn::ConvMatrixCaps conv(nn::ConvMatrixCapsOptions(4, 5).kernel_size(3).stride(2));
  auto c2 = conv->forward(caps);  // (7 - 3) / 2 + 1 = 3
  EXPECT_EQ(c2.poses.sizes(), (std::vector<int64_t>{2, 3, 3, 5, 16}));
  EXPECT_EQ(c2.activations.sizes(), (std::vector<int64_t>{2, 3, 3, 5}));
  EXPECT_EQ(conv->weight.sizes(), (std::vector<int64_t>{9 * 4, 5, 4, 4}));
  nn::ClassMatrixCaps cls(nn::ClassMatrixCapsOptions(5, 10));
  auto out = cls->forward(c2);
  EXPECT_EQ(out.poses.sizes(), (std::vector<int64_t>{2, 10, 16}));
  EXPECT_EQ(out.activations.sizes(), (std::vector<int64_t>{2, 10}));

  models::MatrixCapsNetConfig cfg;  // the default small model: 28 -> 12 -> 5 -> 3
  EXPECT_EQ(cfg.grid_sides(), (std::array<int64_t, 3>{12, 5, 3}));
  models::MatrixCapsNet net(cfg);
  auto y = net->forward(torch::rand({2, 1, 28, 28}));
  EXPECT_EQ(y.activations.sizes(), (std::vector<int64_t>{2, 10}));
  EXPECT_EQ(y.poses.sizes(), (std::vector<int64_t>{2, 10, 16}));
}

TEST(MatrixCaps, PrimaryPosesAreTheConvChannelsOfOnePosition) {
  // A plain view instead of the permute would mix pose elements of different positions.
  torch::manual_seed(1);
  nn::PrimaryMatrixCaps primary(nn::PrimaryMatrixCapsOptions(2, 3));
  auto x = torch::randn({1, 2, 4, 5});
  auto caps = primary->forward(x);
  auto conv = primary->pose->forward(x);  // [1, 3 * 16, 4, 5]
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t e = 0; e < 16; e += 5)
      EXPECT_FLOAT_EQ(caps.poses[0][2][3][t][e].item<float>(), conv[0][t * 16 + e][2][3].item<float>());
}

TEST(MatrixCaps, ConvVotesArePoseTimesWeightOfTheWindow) {
  ScopedThreads one(1);
  torch::manual_seed(3);
  const int64_t K = 3, s = 2, Bin = 2, C = 3;
  nn::ConvMatrixCaps conv(nn::ConvMatrixCapsOptions(Bin, C).kernel_size(K).stride(s));
  nn::MatrixCaps in{torch::randn({2, 7, 6, Bin, 16}), torch::rand({2, 7, 6, Bin})};
  auto [V, a] = conv->votes(in);
  const int64_t Ho = 3, Wo = 2;  // (7 - 3) / 2 + 1, (6 - 3) / 2 + 1
  ASSERT_EQ(V.sizes(), (std::vector<int64_t>{2 * Ho * Wo, K * K * Bin, C, 16}));
  for (int64_t n : {0, 1})
    for (int64_t y : {0, 2})
      for (int64_t x : {1})
        for (int64_t ky : {0, 2})
          for (int64_t kx : {1, 2})
            for (int64_t b = 0; b < Bin; ++b) {
              const int64_t window = (n * Ho + y) * Wo + x, i = (ky * K + kx) * Bin + b;
              auto M = in.poses[n][y * s + ky][x * s + kx][b].view({4, 4});
              for (int64_t c = 0; c < C; ++c) {
                auto expected = torch::matmul(M, conv->weight[i][c]).flatten();
                expect_close(V[window][i][c], expected, 1e-5, "vote");
              }
              EXPECT_EQ(a[window][i].item<float>(), in.activations[n][y * s + ky][x * s + kx][b].item<float>());
            }
}

TEST(MatrixCaps, ClassCapsCoordinateAddition) {
  ScopedThreads one(1);
  torch::manual_seed(4);
  nn::ClassMatrixCaps with(nn::ClassMatrixCapsOptions(2, 3).coordinate_addition(true));
  nn::ClassMatrixCaps without(nn::ClassMatrixCapsOptions(2, 3).coordinate_addition(false));
  without->weight.data().copy_(with->weight.data());
  nn::MatrixCaps in{torch::randn({1, 3, 4, 2, 16}), torch::rand({1, 3, 4, 2})};
  auto diff = (with->votes(in).first - without->votes(in).first).view({1, 3, 4, 2, 3, 16});
  for (int64_t y = 0; y < 3; ++y)
    for (int64_t x = 0; x < 4; ++x) {
      auto d = diff[0][y][x];  // [2, 3, 16]: the same offset for every child type and class
      EXPECT_NEAR(d.select(2, 3).min().item<float>(), (y + 0.5) / 3, 1e-5);  // row -> element [0][3]
      EXPECT_NEAR(d.select(2, 3).max().item<float>(), (y + 0.5) / 3, 1e-5);
      EXPECT_NEAR(d.select(2, 7).min().item<float>(), (x + 0.5) / 4, 1e-5);  // column -> element [1][3]
      EXPECT_NEAR(d.select(2, 7).max().item<float>(), (x + 0.5) / 4, 1e-5);
      d.select(2, 3).zero_();
      d.select(2, 7).zero_();
      EXPECT_LT(d.abs().max().item<float>(), 1e-5);  // nothing else changes
    }
}

TEST(MatrixCaps, ConvCapsGradcheckFloat64) {
  torch::manual_seed(5);
  nn::ConvMatrixCaps conv(nn::ConvMatrixCapsOptions(1, 2).kernel_size(2).stride(1));
  conv->to(torch::kDouble);
  auto poses = (0.5 * torch::randn({1, 3, 2, 1, 16}, torch::kDouble)).requires_grad_(true);
  auto acts = (0.2 + 0.6 * torch::rand({1, 3, 2, 1}, torch::kDouble)).requires_grad_(true);
  auto weight = conv->weight;  // checked too: the function reads the module's parameter
  auto fn = [&](const std::vector<torch::Tensor>& x) {
    auto r = conv->forward({x[0], x[1]});
    return torch::cat({r.poses.flatten(), r.activations.flatten()});
  };
  testing::GradcheckOptions go;
  go.max_elements = 24;
  EXPECT_TRUE(testing::gradcheck(fn, {poses, acts, weight}, go));
}

// The global index of child i of window w (ConvMatrixCaps::votes order) in an N x H x W x B_in grid.
int64_t global_child(const nn::WindowGeometry& g, int64_t w, int64_t i) {
  const int64_t Ho = g.out_height(), Wo = g.out_width(), K = g.kernel, Bin = g.in_types;
  const int64_t n = w / (Ho * Wo), oy = (w / Wo) % Ho, ox = w % Wo;
  const int64_t ky = i / (K * Bin), kx = (i / Bin) % K, b = i % Bin;
  return ((n * g.height + oy * g.stride + ky) * g.width + ox * g.stride + kx) * Bin + b;
}

TEST(MatrixCaps, CrossWindowRSumsToOnePerChildAcrossWindows) {
  // R = exp(log_weights - cross_window_child_log_total): summed over every parent of every window that
  // contains a child it is 1, for every child a window covers (border children belong to fewer
  // windows; the last column of a 7x6 grid with K = 3, s = 2 belongs to none). The initial R
  // (log weights 0) is 1 / (windows containing the child x C). Log weights differ by hundreds between
  // windows, which a shift that were not per child would turn into 0 / 0.
  ScopedThreads one(1);
  torch::manual_seed(13);
  const int64_t C = 3;
  for (const auto& [H, W, K, s] : std::vector<std::array<int64_t, 4>>{{6, 6, 3, 1}, {7, 6, 3, 2}, {5, 5, 2, 1}}) {
    nn::WindowGeometry g;
    g.batch = 2, g.height = H, g.width = W, g.in_types = 2, g.kernel = K, g.stride = s;
    const int64_t windows = g.batch * g.out_height() * g.out_width(), I = K * K * g.in_types;
    const std::string tag = fmt::format("{}x{} K={} s={}", H, W, K, s);
    for (const auto dtype : {torch::kDouble, torch::kFloat}) {
      auto log_weights = 3 * torch::randn({windows, I, C}, dtype) + 300 * torch::randn({windows, 1, 1}, dtype);
      auto R = torch::exp(log_weights - nn::cross_window_child_log_total(log_weights, g)).to(torch::kDouble);
      // [windows, I, 1]: the same share for every parent of a window
      auto R0 = torch::exp(-nn::cross_window_child_log_total(torch::zeros({windows, I, C}, dtype), g)).to(torch::kDouble);
      ASSERT_TRUE(torch::isfinite(R).all().item<bool>()) << tag;
      auto r = R.accessor<double, 3>();
      auto r0 = R0.accessor<double, 3>();
      std::vector<double> sum(static_cast<size_t>(g.batch * H * W * g.in_types), 0.0), count(sum.size(), 0.0);
      for (int64_t w = 0; w < windows; ++w)
        for (int64_t i = 0; i < I; ++i) {
          const auto child = static_cast<size_t>(global_child(g, w, i));
          count[child] += 1;
          for (int64_t c = 0; c < C; ++c) sum[child] += r[w][i][c];
        }
      double max_windows = 0, min_windows = 1e9;
      for (size_t child = 0; child < sum.size(); ++child) {
        if (count[child] == 0) continue;  // not in any window
        // float32: log weights of size ~1000 carry absolute rounding errors ~1e-4 into exp.
        EXPECT_NEAR(sum[child], 1.0, dtype == torch::kDouble ? 1e-12 : 1e-3) << tag << " child " << child;
        max_windows = std::max(max_windows, count[child]);
        min_windows = std::min(min_windows, count[child]);
      }
      EXPECT_EQ(min_windows, 1) << tag;  // a corner
      EXPECT_EQ(max_windows, s == 1 ? double(K * K) : 4.0) << tag;
      for (int64_t w = 0; w < windows; ++w)
        for (int64_t i = 0; i < I; ++i)
          EXPECT_NEAR(r0[w][i][0], 1.0 / (count[static_cast<size_t>(global_child(g, w, i))] * C), 1e-6) << tag;
    }
  }
}

// A small double-precision ConvMatrixCaps with random betas and routing options `routing`.
nn::ConvMatrixCaps small_conv(int64_t K, int64_t s, bool cross, const EmRoutingOptions& routing, uint64_t seed) {
  torch::manual_seed(seed);
  nn::ConvMatrixCaps conv(nn::ConvMatrixCapsOptions(2, 2).kernel_size(K).stride(s).cross_window(cross).routing(routing));
  conv->to(torch::kDouble);
  torch::NoGradGuard no_grad;
  conv->beta_u.copy_(0.5 + 0.3 * torch::randn({2}, torch::kDouble));
  conv->beta_a.copy_(0.3 * torch::randn({2}, torch::kDouble));
  return conv;
}

TEST(MatrixCaps, CrossWindowRoutingMatchesLoopReference) {
  // ConvMatrixCaps::forward (em_routing + the fold normaliser) == the loop reference with explicit global
  // child indices, in values and in the gradients w.r.t. poses, activations, W, beta_u, beta_a (float64).
  // lambda is raised (base 1, not 0.01) so that the activations and R depend strongly on the votes.
  ScopedThreads one(1);
  struct Case {
    int64_t N, H, W, K, s;
    bool cross, outside, paper;
  };
  const std::vector<Case> cases = {
      {1, 4, 4, 3, 1, true, true, true},  {2, 5, 5, 3, 2, true, true, true},  {1, 5, 4, 2, 1, true, false, false},
      {1, 5, 5, 3, 2, true, false, true}, {1, 5, 5, 3, 1, false, true, true},
  };
  for (const auto& c : cases) {
    EmRoutingOptions routing;
    routing.iterations = 3;
    routing.logit_offset_outside_lambda = c.outside;
    routing.inverse_temperature =
        c.paper ? paper_inverse_temperature_schedule(3, 1.0) : inverse_temperature_schedule(3, 0.05, 0.2);
    auto conv = small_conv(c.K, c.s, c.cross, routing, 30);
    const std::string tag = fmt::format("N={} {}x{} K={} s={} {} offset {} {}", c.N, c.H, c.W, c.K, c.s,
                                        c.cross ? "cross-window" : "per-window", c.outside ? "outside" : "inside",
                                        c.paper ? "paper lambda" : "linear lambda");
    auto poses = (0.5 * torch::randn({c.N, c.H, c.W, 2, 16}, torch::kDouble)).requires_grad_(true);
    auto acts = (0.1 + 0.8 * torch::rand({c.N, c.H, c.W, 2}, torch::kDouble)).requires_grad_(true);
    nn::MatrixCaps in{poses, acts};
    auto fast = conv->forward(in);
    const auto g = conv->geometry(in);
    auto [V, a] = conv->votes(in);
    auto ref = nn::detail::reference_conv_em_routing(V, a, conv->beta_u, conv->beta_a, routing, g, c.cross);
    expect_close(fast.poses.reshape({-1, 2, 16}), ref.poses, 1e-10, tag + " poses");
    expect_close(fast.activations.reshape({-1, 2}), ref.activations, 1e-10, tag + " activations");
    const std::vector<torch::Tensor> wrt = {poses, acts, conv->weight, conv->beta_u, conv->beta_a};
    auto Rp = torch::randn_like(ref.poses), Ra = torch::randn_like(ref.activations);
    auto gf = torch::autograd::grad({(fast.poses.reshape({-1, 2, 16}) * Rp).sum() +
                                     (fast.activations.reshape({-1, 2}) * Ra).sum()},
                                    wrt);
    auto gr = torch::autograd::grad({(ref.poses * Rp).sum() + (ref.activations * Ra).sum()}, wrt);
    const char* names[] = {"poses", "activations", "weight", "beta_u", "beta_a"};
    for (size_t k = 0; k < wrt.size(); ++k) {
      EXPECT_GT(gr[k].abs().max().item<double>(), 1e-8) << tag << " gradient of " << names[k] << " is zero";
      expect_close(gf[k], gr[k], 1e-9, tag + " gradient of " + names[k]);
    }
    if (c.cross && c.s < c.K) {  // overlapping windows: the two normalisations must really differ
      auto per_window =
          nn::detail::reference_conv_em_routing(V, a, conv->beta_u, conv->beta_a, routing, g, /*cross_window=*/false);
      EXPECT_GT((per_window.poses - ref.poses).abs().max().item<double>(), 1e-6) << tag;
    }
  }
}

TEST(MatrixCaps, StandardizedCostConvCapsMatchesLoopReference) {
  // standardize_cost in a convolutional layer: per window over its C parents, cross-window and
  // per-window, == the loop reference in values and gradients (float64).
  ScopedThreads one(1);
  for (const bool cross : {true, false}) {
    EmRoutingOptions routing;
    routing.standardize_cost = true;
    routing.inverse_temperature = {1.0, 1.0, 1.0};
    auto conv = small_conv(3, 1, cross, routing, 33);
    const std::string tag = cross ? "cross-window" : "per-window";
    auto poses = (0.5 * torch::randn({1, 4, 4, 2, 16}, torch::kDouble)).requires_grad_(true);
    auto acts = (0.1 + 0.8 * torch::rand({1, 4, 4, 2}, torch::kDouble)).requires_grad_(true);
    nn::MatrixCaps in{poses, acts};
    auto fast = conv->forward(in);
    auto [V, a] = conv->votes(in);
    auto ref =
        nn::detail::reference_conv_em_routing(V, a, conv->beta_u, conv->beta_a, routing, conv->geometry(in), cross);
    expect_close(fast.poses.reshape({-1, 2, 16}), ref.poses, 1e-10, tag + " poses");
    expect_close(fast.activations.reshape({-1, 2}), ref.activations, 1e-10, tag + " activations");
    const std::vector<torch::Tensor> wrt = {poses, acts, conv->weight, conv->beta_u, conv->beta_a};
    auto Ra = torch::randn_like(ref.activations);
    auto gf = torch::autograd::grad({(fast.poses.reshape({-1, 2, 16})).sum() + (fast.activations.reshape({-1, 2}) * Ra).sum()}, wrt);
    auto gr = torch::autograd::grad({ref.poses.sum() + (ref.activations * Ra).sum()}, wrt);
    for (size_t k = 0; k < wrt.size(); ++k) expect_close(gf[k], gr[k], 1e-9, tag + fmt::format(" gradient {}", k));
  }
}

TEST(MatrixCaps, CrossWindowEqualsPerWindowWithoutOverlap) {
  // Stride = kernel: every child is in at most one window, so both normalisations are the same.
  ScopedThreads one(1);
  EmRoutingOptions routing;
  routing.inverse_temperature = paper_inverse_temperature_schedule(3, 1.0);
  auto cross = small_conv(2, 2, true, routing, 31), per_window = small_conv(2, 2, false, routing, 31);
  nn::MatrixCaps in{0.5 * torch::randn({2, 5, 4, 2, 16}, torch::kDouble), torch::rand({2, 5, 4, 2}, torch::kDouble)};
  auto a = cross->forward(in), b = per_window->forward(in);
  expect_close(a.poses, b.poses, 1e-12, "poses");
  expect_close(a.activations, b.activations, 1e-12, "activations");
}

TEST(MatrixCaps, CrossWindowConvCapsGradcheckFloat64) {
  // Finite differences through the fold normaliser, on a grid with overlapping windows (3x3, K = 2,
  // s = 1) and on one with a row and a column that no window covers (3x3, K = 2, s = 2: their
  // gradients must be 0, not NaN).
  for (const int64_t s : {1, 2}) {
    EmRoutingOptions routing;
    routing.inverse_temperature = paper_inverse_temperature_schedule(3, 1.0);
    auto conv = small_conv(2, s, true, routing, 32);
    auto poses = (0.5 * torch::randn({1, 3, 3, 2, 16}, torch::kDouble)).requires_grad_(true);
    auto acts = (0.2 + 0.6 * torch::rand({1, 3, 3, 2}, torch::kDouble)).requires_grad_(true);
    auto fn = [&](const std::vector<torch::Tensor>& x) {
      auto r = conv->forward({x[0], x[1]});
      return torch::cat({r.poses.flatten(), r.activations.flatten()});
    };
    testing::GradcheckOptions go;
    go.max_elements = 24;
    EXPECT_TRUE(testing::gradcheck(fn, {poses, acts, conv->weight, conv->beta_a}, go)) << "stride " << s;
    if (s == 2) {
      auto r = conv->forward({poses, acts});
      auto grads = torch::autograd::grad({r.poses.sum() + r.activations.sum()}, {poses, acts});
      for (const auto& gr : grads) {
        EXPECT_TRUE(torch::isfinite(gr).all().item<bool>());
        EXPECT_EQ(gr.select(1, 2).abs().max().item<double>(), 0.0);  // uncovered row
        EXPECT_EQ(gr.select(2, 2).abs().max().item<double>(), 0.0);  // uncovered column
      }
    }
  }
}

TEST(MatrixCaps, ConfigWithoutIssue14KeysKeepsTheOldRouting) {
  ScopedThreads one(1);
  models::MatrixCapsNetConfig fresh;  // new models: the published routing
  EXPECT_EQ(fresh.lambda_schedule, "paper");
  EXPECT_TRUE(fresh.logit_offset_outside_lambda);
  EXPECT_TRUE(fresh.cross_window_routing);
  // The paper's schedule with lambda_0 = 1 (the authors' 0.01 x the ~100x their cost is larger than the
  // J/I-scaled one) and a sigma^2 floor of 0.1: the settings that learn (docs/em.md).
  EXPECT_EQ(fresh.routing().inverse_temperature, paper_inverse_temperature_schedule(3, 1.0));
  EXPECT_EQ(fresh.routing().variance_eps, 0.1);
  EXPECT_TRUE(fresh.routing().normalize_cost);
  EXPECT_EQ(models::MatrixCapsNetConfig::from_json(fresh.to_json()).to_json(), fresh.to_json());

  // A config (or checkpoint) written before issue 14 has none of the new keys: it means the old routing.
  auto json = tiny_em_config().to_json();
  for (const char* key :
       {"lambda_schedule", "lambda_base", "logit_offset_outside_lambda", "cross_window_routing", "standardize_cost",
        "variance_eps"})
    ASSERT_EQ(json.erase(key), 1u) << key;
  const auto old = models::MatrixCapsNetConfig::from_json(json);
  EXPECT_EQ(old.lambda_schedule, "linear");
  EXPECT_FALSE(old.logit_offset_outside_lambda);
  EXPECT_FALSE(old.cross_window_routing);
  EXPECT_FALSE(old.standardize_cost);
  EXPECT_FALSE(old.routing().standardize_cost);
  EXPECT_EQ(old.routing().variance_eps, 1e-4);
  const auto routing = old.routing();
  EXPECT_EQ(routing.inverse_temperature, (std::vector<double>{0.01, 0.01, 0.01}));
  EXPECT_FALSE(routing.logit_offset_outside_lambda);

  // The model it builds computes exactly the pre-issue-14 forward pass: every layer routed by
  // em_routing per window with lambda 0.01 inside the logistic.
  torch::manual_seed(6);
  models::MatrixCapsNet net(old);
  EXPECT_FALSE(net->conv_caps1->options.cross_window());
  EXPECT_FALSE(net->conv_caps2->options.cross_window());
  auto images = torch::rand({2, 1, 28, 28});
  auto out = net->forward(images);
  auto caps = net->primary->forward(torch::relu(net->conv1->forward(images)));
  for (auto* layer : {&net->conv_caps1, &net->conv_caps2}) {
    auto [V, a] = (*layer)->votes(caps);
    auto r = em_routing(V, a, (*layer)->beta_u, (*layer)->beta_a, routing);
    const auto g = (*layer)->geometry(caps);
    caps = nn::MatrixCaps{r.poses.view({g.batch, g.out_height(), g.out_width(), -1, 16}),
            r.activations.view({g.batch, g.out_height(), g.out_width(), -1})};
  }
  auto [V, a] = net->class_caps->votes(caps);
  auto by_hand = em_routing(V, a, net->class_caps->beta_u, net->class_caps->beta_a, routing);
  expect_close(out.activations, by_hand.activations, 0, "activations");
  expect_close(out.poses, by_hand.poses, 0, "poses");

  auto bad = fresh.to_json();
  bad["lambda_schedule"] = "cosine";
  try {
    models::MatrixCapsNetConfig::from_json(bad);
    ADD_FAILURE() << "lambda_schedule \"cosine\" was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lambda_schedule"), std::string::npos) << e.what();
  }
}

TEST(MatrixCaps, BadInputThrowsNamingTheLayer) {
  nn::ConvMatrixCaps conv(nn::ConvMatrixCapsOptions(2, 3).kernel_size(3));
  EXPECT_THROW(conv->forward({torch::randn({1, 5, 5, 3, 16}), torch::rand({1, 5, 5, 3})}), std::invalid_argument);
  try {
    conv->forward({torch::randn({1, 2, 2, 2, 16}), torch::rand({1, 2, 2, 2})});
    ADD_FAILURE() << "a 2x2 grid with a 3x3 kernel was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("kernel_size"), std::string::npos) << e.what();
  }
  try {
    conv->forward({torch::randn({1, 5, 5, 2, 16}), torch::rand({1, 5, 4, 2})});
    ADD_FAILURE() << "mismatched activations were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("activations"), std::string::npos) << e.what();
  }
  EXPECT_THROW(nn::ConvMatrixCaps(nn::ConvMatrixCapsOptions(0, 3)), std::invalid_argument);
  models::MatrixCapsNetConfig cfg;
  cfg.image_size = 10;  // 10 -> 3 -> 1: no room for ConvCaps2's 3x3 kernel
  try {
    cfg.validate();
    ADD_FAILURE() << "image_size 10 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("image_size"), std::string::npos) << e.what();
  }
  models::MatrixCapsNet net(models::MatrixCapsNetConfig{});
  EXPECT_THROW(net->forward(torch::rand({1, 1, 20, 20})), std::invalid_argument);
}

TEST(EmTraining, AdamStepsOnOneBatchLowerItsSpreadLoss) {
  // Gradients through three EM-routed capsule layers must point downhill: a few small Adam steps on
  // one fixed batch (fixed margin) lower that batch's spread loss.
  ScopedThreads one(1);
  auto set = testing::synthetic_set(10, 28, 21);
  torch::manual_seed(3);
  models::MatrixCapsNet net(tiny_em_config());
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  auto images = experiments::to_input(set.images);
  std::vector<double> losses;
  for (int step = 0; step < 8; ++step) {
    auto loss = spread_loss(net->forward(images).activations, set.labels, 0.5);
    losses.push_back(loss.item<double>());
    adam.zero_grad();
    loss.backward();
    adam.step();
  }
  EXPECT_LT(losses.back(), losses.front() - 1e-3) << "spread loss " << losses.front() << " -> " << losses.back();
}

// A `steps`-step training run of the tiny model in batches of 8: no evaluation, no progress bars, every step logged.
experiments::EmTrainOptions quiet_em_options(int64_t steps) {
  experiments::EmTrainOptions o;
  o.model = tiny_em_config();
  o.loop.max_steps = steps;
  o.loop.batch_size = 8;
  o.test_size = 0;
  o.loop.log_every = 1;
  o.loop.progress = false;
  return o;
}

TEST(EmTraining, PreIssue14CheckpointResumesOnlyWithTheOldRouting) {
  // A checkpoint whose stored model config lacks the issue-14 keys (written before them) means the
  // old routing: it resumes into a run configured with the old routing and is refused by one with the
  // new defaults (instead of silently continuing under another routing).
  ScopedThreads one(1);
  testing::TempDir dir;
  auto set = testing::synthetic_set(16, 28, 5);
  auto o = quiet_em_options(2);
  o.model.lambda_schedule = "linear";
  o.model.logit_offset_outside_lambda = false;
  o.model.cross_window_routing = false;
  o.loop.out_dir = dir / "a";
  std::ostringstream log;
  const auto first = experiments::train_em(o, set, nullptr, log);
  auto meta = train::read_checkpoint_meta(first.checkpoint);
  models::MatrixCapsNet net(o.model);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(o.loop.lr));
  train::load_checkpoint(first.checkpoint, *net, &adam, [](const nlohmann::json&) { return true; });
  for (const char* key : {"lambda_schedule", "lambda_base", "logit_offset_outside_lambda", "cross_window_routing"})
    ASSERT_EQ(meta.model_config.erase(key), 1u) << key;
  const std::string old_path = dir / "old.pt";
  train::save_checkpoint(old_path, *net, &adam, meta);

  auto resumed = o;
  resumed.loop.out_dir = dir / "b";
  resumed.loop.max_steps = 3;
  resumed.loop.resume = old_path;
  EXPECT_EQ(experiments::train_em(resumed, set, nullptr, log).steps, 3) << log.str();
  auto fresh = resumed;
  fresh.model = tiny_em_config();
  fresh.loop.out_dir = dir / "c";
  EXPECT_ANY_THROW(experiments::train_em(fresh, set, nullptr, log));
}

TEST(EmTraining, ShiftAugmentationMovesTheImagesAndResumesExactly) {
  // --max-shift draws its shifts from the loop's generator: two steps, a checkpoint and a resume to
  // four end with the weights of four straight steps; without shifts the weights differ (the option
  // reaches the batches); a shift as large as the image is refused.
  ScopedThreads one(1);
  testing::TempDir dir;
  auto set = testing::synthetic_set(32, 28, 9);
  auto o = quiet_em_options(4);
  o.max_shift = 2;
  o.margin_start = o.margin_end = 0.5;  // a margin that does not depend on the run's length
  std::ostringstream log;
  auto run = [&](experiments::EmTrainOptions options, const std::string& name) {
    options.loop.out_dir = dir / name;
    return experiments::train_em(options, set, nullptr, log);
  };
  const auto straight = run(o, "straight");
  auto first_half = o;
  first_half.loop.max_steps = 2;
  const auto half = run(first_half, "half");
  auto second_half = o;
  second_half.loop.resume = half.checkpoint;
  const auto resumed = run(second_half, "resumed");
  auto unshifted = o;
  unshifted.max_shift = 0;
  const auto plain = run(unshifted, "plain");
  ASSERT_EQ(resumed.steps, 4) << log.str();
  double resume_gap = 0, shift_effect = 0;
  const auto a = straight.model->parameters(), b = resumed.model->parameters(), c = plain.model->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    resume_gap = std::max(resume_gap, (a[i] - b[i]).abs().max().item<double>());
    shift_effect = std::max(shift_effect, (a[i] - c[i]).abs().max().item<double>());
  }
  EXPECT_EQ(resume_gap, 0.0);
  EXPECT_GT(shift_effect, 1e-6);
  // A run with shifts does not resume from one without (the batches would differ from the first run's).
  auto mixed = o;
  mixed.loop.resume = plain.checkpoint;
  mixed.loop.max_steps = 5;
  EXPECT_ANY_THROW(run(mixed, "mixed"));
  auto too_far = o;
  too_far.max_shift = 28;
  EXPECT_THROW(too_far.validate(), std::invalid_argument);
}

// The small network every `capsnet em` test trains.
const std::string kTinyEm = " --conv1-channels 4 --primary-types 2 --caps1-types 2 --caps2-types 2";

// A folder with 64 training and 30 test digits for `capsnet em` runs.
struct EmFolder : testing::CliFolder {
  EmFolder() { testing::write_fake_mnist(data, 64, 30); }
};

// Runs `capsnet em` in `run` writing to `out`, expects it to succeed and returns its output and em.json.
struct EmRun {
  std::string output;
  nlohmann::json em;
};
EmRun run_em(const testing::CliFolder& run, const std::string& out, const std::string& flags) {
  auto r = run.run_to(out, "em", flags);
  EXPECT_EQ(r.status, 0) << r.output;
  std::ifstream in(out + "/em.json");
  EXPECT_TRUE(in.good()) << "no em.json in " << out << "\n" << r.output;
  return {r.output, in.good() ? nlohmann::json::parse(in) : nlohmann::json::object()};
}

TEST(EmCli, TrainsAndEvaluatesOnGeneratedIdx) {
  const EmFolder run;
  const std::string& out = run.out;
  const auto [output, j] = run_em(run, out, "--steps 3 --batch-size 8 --test-size 20 --routing-iters 2" + kTinyEm);
  ASSERT_FALSE(HasFailure());
  EXPECT_NE(output.find("test: accuracy"), std::string::npos) << output;
  EXPECT_EQ(j["steps"], 3);
  EXPECT_EQ(j["test_examples"], 20);
  EXPECT_GE(j["test_accuracy"].get<double>(), 0.0);
  EXPECT_LE(j["test_accuracy"].get<double>(), 1.0);
  EXPECT_EQ(j["model"]["routing_iterations"], 2);
  EXPECT_EQ(j["model"]["lambda_schedule"], "paper");  // the published routing by default
  EXPECT_EQ(j["model"]["logit_offset_outside_lambda"], true);
  EXPECT_EQ(j["model"]["cross_window_routing"], true);
  EXPECT_EQ(j["model"]["lambda_base"], 1.0);
  EXPECT_EQ(j["model"]["variance_eps"], 0.1);
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint.pt"));
  std::ifstream metrics(out + "/metrics.jsonl");
  int lines = 0;
  bool saw_eval = false;
  for (std::string line; std::getline(metrics, line); ++lines)
    saw_eval |= nlohmann::json::parse(line)["event"] == "eval";
  EXPECT_GE(lines, 4);  // start, train, eval, end
  EXPECT_TRUE(saw_eval);

  // The earlier routing variants, by flags.
  const auto lj = run_em(run, run.dir / "legacy",
                         "--steps 1 --batch-size 8 --test-size 0 --routing-iters 2 --lambda-schedule linear"
                         " --lambda-first 0.5 --lambda-last 1 --logit-offset inside --window-routing per-window" +
                             kTinyEm)
                      .em;
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(lj["model"]["lambda_schedule"], "linear");
  EXPECT_EQ(lj["model"]["lambda_first"], 0.5);
  EXPECT_EQ(lj["model"]["logit_offset_outside_lambda"], false);
  EXPECT_EQ(lj["model"]["cross_window_routing"], false);
  for (const std::string flag : {"--lambda-schedule cosine", "--logit-offset above", "--window-routing all"})
    EXPECT_TRUE(testing::FailsSaying(run.run("em", "--overwrite " + flag), flag.substr(0, flag.find(' '))));

  const std::string missing = run.dir / "missing";
  EXPECT_TRUE(testing::FailsSaying(
      testing::run_cli("em --data " + missing + " --out " + out + " --steps 1 --no-progress --overwrite"), "missing"));
  EXPECT_TRUE(testing::FailsSaying(run.run("em", "--batch-size 0"), "batch-size"));
}

TEST(EmCli, EvalEveryStandardizedCostLambdaBaseLrDecayAndMaxShiftReachTheRun) {
  // The flags added after issue 14's first runs: --eval-every (test accuracy mid-run), --standardize-cost,
  // --lambda-base (paper schedule's lambda_0), --lr-decay (per epoch, smooth per step), --max-shift.
  const EmFolder run;
  const std::string& out = run.out;
  const auto j = run_em(run, out,
                        "--steps 4 --batch-size 8 --train-size 16 --test-size 10 --eval-every 2 --log-every 1"
                        " --standardize-cost --lambda-base 0.5 --lr-decay 0.5 --variance-eps 0.05 --max-shift 3" +
                            kTinyEm)
                     .em;
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(j["model"]["standardize_cost"], true);
  EXPECT_EQ(j["model"]["lambda_base"], 0.5);
  EXPECT_EQ(j["model"]["variance_eps"], 0.05);
  EXPECT_EQ(j["train"]["lr_decay"], 0.5);
  EXPECT_EQ(j["train"]["eval_every"], 2);
  EXPECT_EQ(j["train"]["max_shift"], 3);
  std::ifstream metrics(out + "/metrics.jsonl");
  std::vector<int64_t> eval_steps;
  std::vector<double> lrs;
  for (std::string line; std::getline(metrics, line);) {
    auto rec = nlohmann::json::parse(line);
    if (rec["event"] == "eval") eval_steps.push_back(rec["step"].get<int64_t>());
    if (rec["event"] == "train") lrs.push_back(rec["lr"].get<double>());
  }
  ASSERT_FALSE(eval_steps.empty());
  EXPECT_EQ(eval_steps.front(), 2) << "first evaluation after step 2";
  EXPECT_EQ(eval_steps.back(), 4);
  ASSERT_EQ(lrs.size(), 4u);
  EXPECT_DOUBLE_EQ(lrs.front(), 3e-3);  // 2 steps per epoch: 0.5 per epoch is 0.5^(1/2) per step
  for (size_t k = 1; k < lrs.size(); ++k) EXPECT_NEAR(lrs[k] / lrs[k - 1], std::sqrt(0.5), 1e-9) << k;
  for (const std::string flag : {"--lambda-base 0", "--variance-eps 0", "--max-shift -1", "--max-shift 28"}) {
    auto bad = run.run("em", "--overwrite " + flag);
    EXPECT_NE(bad.status, 0) << flag;
    // The error names the flag, or the option behind it (e.g. "max_shift" for a value the flag's check lets through).
    const auto name = flag.substr(0, flag.find(' '));
    auto option = name.substr(2);
    std::replace(option.begin(), option.end(), '-', '_');
    EXPECT_TRUE(bad.output.find(name) != std::string::npos || bad.output.find(option) != std::string::npos)
        << flag << ": " << bad.output;
  }
  models::MatrixCapsNetConfig zero_floor;
  zero_floor.variance_eps = 0;
  EXPECT_THROW(zero_floor.validate(), std::invalid_argument);
  // The floor reaches every capsule layer's routing.
  zero_floor.variance_eps = 0.25;
  models::MatrixCapsNet net(zero_floor);
  EXPECT_EQ(net->conv_caps1->options.routing().variance_eps, 0.25);
  EXPECT_EQ(net->class_caps->options.routing().variance_eps, 0.25);
}

TEST(EmCli, ExportEvalAndPredictTakeTheRunsModelAndOtherCommandsRefuseIt) {
  // capsnet eval on the run's checkpoint and on its exported weights gives the accuracy the run
  // reported, predict agrees with it image by image; reconstruct (CapsNet only) says what the file holds.
  const EmFolder run;
  const std::string& data = run.data;
  const auto [output, j] = run_em(run, run.out, "--steps 3 --batch-size 8 --test-size 30 --routing-iters 2" + kTinyEm);
  ASSERT_FALSE(HasFailure());
  const std::string ckpt = run.out + "/checkpoint.pt", weights = run.dir / "em.pt";
  auto exported = testing::run_cli("export --checkpoint " + ckpt + " --out " + weights + " --probe 2 --threads 1");
  ASSERT_EQ(exported.status, 0) << exported.output;
  EXPECT_NE(exported.output.find("(step 3)"), std::string::npos) << exported.output;

  for (const std::string& file : {ckpt, weights}) {
    auto r = testing::run_cli("eval --checkpoint " + file + " --data " + data + " --batch-size 100 --json --threads 1");
    ASSERT_EQ(r.status, 0) << r.output;
    const auto e = nlohmann::json::parse(r.output.substr(r.output.find('{')));
    EXPECT_EQ(e["model"], "matrix-capsnet") << file;
    EXPECT_EQ(e["examples"], 30) << file;
    EXPECT_DOUBLE_EQ(e["accuracy"].get<double>(), j["test_accuracy"].get<double>()) << file;
    int64_t total = 0, diagonal = 0;
    for (size_t k = 0; k < e["confusion"].size(); ++k) {
      int64_t row = 0;
      for (const auto& v : e["confusion"][k]) row += v.get<int64_t>();
      EXPECT_EQ(row, 3) << "label " << k;  // write_fake_mnist: labels i % 10
      total += row;
      diagonal += e["confusion"][k][k].get<int64_t>();
    }
    EXPECT_EQ(total, 30);
    EXPECT_EQ(diagonal, std::llround(30 * e["accuracy"].get<double>()));
  }
  auto text = testing::run_cli("eval --checkpoint " + weights + " --data " + data + " --threads 1 --no-progress");
  ASSERT_EQ(text.status, 0) << text.output;
  EXPECT_NE(text.output.find("spread loss"), std::string::npos) << text.output;

  // predict takes it too: one JSON line per test image whose prediction is eval's (accuracy over the
  // same 30 images), its activations in (0, 1), its pose the predicted class's 4x4 matrix.
  auto predict = testing::run_cli("predict " + data + "/t10k-images-idx3-ubyte --checkpoint " + weights +
                                  " --limit 30 --json --pose --threads 1");
  ASSERT_EQ(predict.status, 0) << predict.output;
  std::istringstream lines(predict.output);
  int64_t rows = 0, right = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    const auto p = nlohmann::json::parse(line);
    const auto activations = p.at("activations").get<std::vector<double>>();
    ASSERT_EQ(activations.size(), 10u) << line;
    for (double a : activations) EXPECT_TRUE(a > 0 && a < 1) << line;
    const auto best = std::max_element(activations.begin(), activations.end()) - activations.begin();
    EXPECT_EQ(p.at("prediction").get<int64_t>(), best) << line;
    EXPECT_DOUBLE_EQ(p.at("activation").get<double>(), activations[best]) << line;
    EXPECT_EQ(p.at("pose").size(), 16u) << line;
    right += p.at("prediction").get<int64_t>() == rows % 10;  // write_fake_mnist: labels i % 10
    ++rows;
  }
  EXPECT_EQ(rows, 30);
  EXPECT_EQ(right, std::llround(30 * j["test_accuracy"].get<double>()));
  auto csv = testing::run_cli("predict " + data + "/t10k-images-idx3-ubyte --checkpoint " + ckpt +
                              " --limit 1 --format csv --threads 1");
  ASSERT_EQ(csv.status, 0) << csv.output;
  EXPECT_NE(csv.output.find("input,class,label,activation,activation_0,"), std::string::npos) << csv.output;
  // Commands that need a CapsNet's decoder or vectors say what the file holds.
  EXPECT_TRUE(testing::FailsSaying(testing::run_cli("reconstruct --checkpoint " + ckpt + " --data " + data + " --out " +
                                                    (run.dir / "r.png") + " --threads 1"),
                                   "capsnet em"));
}

}  // namespace
}  // namespace capsnet
