// Matrix capsules with EM routing: em_routing vs the loop reference (values, gradients), float64
// gradchecks, routing properties, spread loss by hand, layer shapes and votes, bad input, CLI end to end.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "capsnet/models/matrix_capsnet.h"
#include "capsnet/nn/em_routing.h"
#include "capsnet/nn/matrix_caps.h"
#include "capsnet/train/em.h"
#include "gradcheck.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testutil::ScopedThreads;

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

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double tol, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double diff = (a - b).abs().max().item<double>();
  EXPECT_LE(diff, tol) << what << ": max |diff| " << diff;
}

TEST(EmRouting, FastMatchesReferenceValuesAndGradientsFloat64) {
  ScopedThreads one(1);
  for (const bool normalize : {false, true}) {
    EmRoutingOptions opt;
    opt.iterations = 3;
    opt.inverse_temperature = inverse_temperature_schedule(3, 0.5, 2.0);
    opt.normalize_cost = normalize;
    auto in = make_inputs(2, 5, 3, 4, 7, true);
    auto fast = em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
    auto ref = detail::reference_em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
    const std::string tag = normalize ? "normalized cost" : "paper cost";
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
  EXPECT_TRUE(testutil::gradcheck(fn, in.all()));
  opt.normalize_cost = true;
  EXPECT_TRUE(testutil::gradcheck(fn, in.all()));
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
  // of iterations, and sigma^2 their a-weighted variance (checked through the activation).
  ScopedThreads one(1);
  auto in = make_inputs(2, 6, 1, 4, 9, false);
  for (int64_t iters : {1, 3}) {
    EmRoutingOptions opt;
    opt.iterations = iters;
    auto r = em_routing(in.votes, in.a, in.beta_u, in.beta_a, opt);
    auto w = in.a.unsqueeze(2).unsqueeze(3);                       // [B, I, 1, 1]
    auto mu = (w * in.votes).sum(1) / (w.sum(1) + opt.mass_eps);   // [B, 1, D]
    auto var = (w * (in.votes - mu.unsqueeze(1)).pow(2)).sum(1) / (w.sum(1) + opt.mass_eps) + opt.variance_eps;
    auto mass = in.a.sum(1, true);                                 // [B, 1]
    auto cost = ((in.beta_u.view({1, 1, 1}) + 0.5 * var.log()) * mass.unsqueeze(2)).sum(2);
    auto act = torch::sigmoid(in.beta_a.view({1, 1}) - cost);
    expect_close(r.poses, mu, 1e-12, "poses");
    expect_close(r.activations, act, 1e-12, "activations");
  }
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
  testutil::GradcheckOptions go;
  go.max_elements = 24;
  EXPECT_TRUE(testutil::gradcheck(fn, {poses, acts, weight}, go));
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

models::MatrixCapsNetConfig tiny_em_config() {
  models::MatrixCapsNetConfig c;
  c.conv1_channels = 8;
  c.primary_types = 4;
  c.conv1_caps_types = 4;
  c.conv2_caps_types = 4;
  return c;
}

TEST(EmTraining, AdamStepsOnOneBatchLowerItsSpreadLoss) {
  // Gradients through three EM-routed capsule layers must point downhill: a few small Adam steps on
  // one fixed batch (fixed margin) lower that batch's spread loss.
  ScopedThreads one(1);
  auto set = testing::synthetic_set(10, 28, 21);
  torch::manual_seed(3);
  models::MatrixCapsNet net(tiny_em_config());
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  auto images = train::to_input(set.images);
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

TEST(EmCli, TrainsAndEvaluatesOnGeneratedIdx) {
  testing::TempDir dir;
  testing::write_fake_mnist(dir / "data", 64, 30);
  const std::string out = dir / "out";
  const std::string cmd = std::string(CAPSNET_CLI) + " em --data " + (dir / "data") + " --out " + out +
                          " --steps 3 --batch-size 8 --test-size 20 --conv1-channels 4 --primary-types 2"
                          " --caps1-types 2 --caps2-types 2 --routing-iters 2 --threads 1 --no-progress";
  auto r = testing::run_command(cmd);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("test: accuracy"), std::string::npos) << r.output;
  std::ifstream in(out + "/em.json");
  ASSERT_TRUE(in.good());
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["steps"], 3);
  EXPECT_EQ(j["test_examples"], 20);
  EXPECT_GE(j["test_accuracy"].get<double>(), 0.0);
  EXPECT_LE(j["test_accuracy"].get<double>(), 1.0);
  EXPECT_EQ(j["model"]["routing_iterations"], 2);
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint.pt"));
  std::ifstream metrics(out + "/metrics.jsonl");
  int lines = 0;
  bool saw_eval = false;
  for (std::string line; std::getline(metrics, line); ++lines)
    saw_eval |= nlohmann::json::parse(line)["event"] == "eval";
  EXPECT_GE(lines, 4);  // start, train, eval, end
  EXPECT_TRUE(saw_eval);

  auto bad = testing::run_command(std::string(CAPSNET_CLI) + " em --data " + (dir / "missing") + " --out " + out +
                                  " --steps 1 --no-progress --overwrite");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("missing"), std::string::npos) << bad.output;
  auto bad_size = testing::run_command(std::string(CAPSNET_CLI) + " em --data " + (dir / "data") + " --out " + out +
                                       " --batch-size 0 --no-progress");
  EXPECT_NE(bad_size.status, 0);
  EXPECT_NE(bad_size.output.find("batch-size"), std::string::npos) << bad_size.output;
}

}  // namespace
}  // namespace capsnet
