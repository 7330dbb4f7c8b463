// kernels::FusedAdam against LibTorch's torch::optim::Adam: the same bits, every option, every ISA copy.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "capsnet/ops/routing.h"
#include "capsnet/kernels/fused_adam.h"

#include <sstream>

using namespace capsnet;

namespace {

// Sizes with vector tails for both widths and a span over several parallel chunks; a float64 parameter
// (LibTorch's formula inside FusedAdam) and a non-contiguous one.
std::vector<torch::Tensor> parameters(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({1}).requires_grad_(),
          torch::randn({17}).requires_grad_(),
          torch::randn({70001}).requires_grad_(),
          torch::randn({3, 40}).t().requires_grad_(),
          torch::randn({29}, torch::kDouble).requires_grad_()};
}

// Gradients of every sign and scale, one step's worth per call; the last parameter gets none at odd steps
// (Adam skips it then).
void set_gradients(std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(100 + step);
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if (i + 1 == params.size() && step % 2 == 1) {
      p.mutable_grad() = torch::Tensor();
      continue;
    }
    p.mutable_grad() = torch::randn(p.sizes(), p.options()) * std::pow(10.0, static_cast<double>(i) - 2.0);
  }
}

struct IsaCap {
  explicit IsaCap(ops::CpuIsa isa) { ops::set_cpu_isa(isa); }
  ~IsaCap() { ops::set_cpu_isa(ops::CpuIsa::automatic); }
};

void expect_same_run(const torch::optim::AdamOptions& options, ops::CpuIsa isa, const std::string& what) {
  const IsaCap cap(isa);
  auto reference = parameters(7), fused = parameters(7);
  torch::optim::Adam reference_adam(reference, options);
  auto fused_adam = kernels::make_adam(fused, options);
  for (int step = 0; step < 6; ++step) {
    set_gradients(reference, step);
    set_gradients(fused, step);
    reference_adam.step();
    fused_adam->step();
    for (size_t i = 0; i < reference.size(); ++i)
      ASSERT_TRUE(torch::equal(reference[i].detach(), fused[i].detach()))
          << what << ", parameter " << i << ", step " << step << ": max |diff| "
          << (reference[i] - fused[i]).abs().max().item<double>();
  }
}

}  // namespace

TEST(FusedAdam, EqualsLibTorchsAdamBitForBit) {
  const std::vector<std::pair<std::string, torch::optim::AdamOptions>> settings{
      {"defaults", torch::optim::AdamOptions(1e-3)},
      {"weight decay", torch::optim::AdamOptions(5e-2).weight_decay(0.1)},
      {"amsgrad", torch::optim::AdamOptions(1e-2).amsgrad(true)},
      {"betas (0.5, 0.999), eps 1e-4", torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}).eps(1e-4)},
      {"all", torch::optim::AdamOptions(3e-3).betas({0.8, 0.99}).weight_decay(1e-3).amsgrad(true)}};
  for (const auto isa : {ops::CpuIsa::automatic, ops::CpuIsa::avx2, ops::CpuIsa::baseline})
    for (const auto& [name, options] : settings) expect_same_run(options, isa, name);
}

TEST(FusedAdam, ParameterGroupsKeepTheirOwnOptions) {
  auto reference = parameters(3), fused = parameters(3);
  auto groups = [](std::vector<torch::Tensor>& p) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<torch::Tensor>{p[0], p[1], p[2]});
    g.emplace_back(std::vector<torch::Tensor>{p[3], p[4]},
                   std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(0.5).amsgrad(true)));
    return g;
  };
  torch::optim::Adam reference_adam(groups(reference), torch::optim::AdamOptions(1e-2));
  auto fused_adam = kernels::make_adam(groups(fused), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 4; ++step) {
    set_gradients(reference, step);
    set_gradients(fused, step);
    reference_adam.step();
    fused_adam->step();
    for (size_t i = 0; i < reference.size(); ++i) ASSERT_TRUE(torch::equal(reference[i], fused[i])) << i;
  }
}

TEST(FusedAdam, ItsStateLoadsIntoLibTorchsAdamAndBack) {
  // A checkpoint of one continues in the other with the same numbers (the state is Adam's own).
  auto a = parameters(5), b = parameters(5);
  const auto options = torch::optim::AdamOptions(1e-2).amsgrad(true);
  auto fused = kernels::make_adam(a, options);
  torch::optim::Adam plain(b, options);
  for (int step = 0; step < 3; ++step) {
    set_gradients(a, step);
    set_gradients(b, step);
    fused->step();
    plain.step();
  }
  std::stringstream fused_state, plain_state;
  torch::save(*fused, fused_state);
  torch::save(plain, plain_state);
  // Swap: the plain optimizer continues from the fused one's state and vice versa.
  auto a2 = a, b2 = b;
  torch::optim::Adam plain_from_fused(a2, options);
  auto fused_from_plain = kernels::make_adam(b2, options);
  torch::load(plain_from_fused, fused_state);
  torch::load(*fused_from_plain, plain_state);
  for (int step = 3; step < 6; ++step) {
    set_gradients(a2, step);
    set_gradients(b2, step);
    plain_from_fused.step();
    fused_from_plain->step();
    for (size_t i = 0; i < a2.size(); ++i) ASSERT_TRUE(torch::equal(a2[i], b2[i])) << i << " at step " << step;
  }
}

TEST(FusedAdam, AStepMovesTheParametersVersionCounters) {
  // The inference caches keep a weight's cast, reorder or spectrum until its storage or version changes
  // (kernels/weight_cache.h): a step written through raw pointers must move the version as ATen's in-place ops do.
  auto fused = parameters(9), reference = parameters(9);
  auto fused_adam = kernels::make_adam(fused, torch::optim::AdamOptions(1e-2).amsgrad(true));
  torch::optim::Adam reference_adam(reference, torch::optim::AdamOptions(1e-2).amsgrad(true));
  for (int step = 0; step < 2; ++step) {
    set_gradients(fused, step);
    set_gradients(reference, step);
    std::vector<int64_t> before, reference_before;
    for (const auto& p : fused) before.push_back(p._version());
    for (const auto& p : reference) reference_before.push_back(p._version());
    fused_adam->step();
    reference_adam.step();
    for (size_t i = 0; i < fused.size(); ++i) {
      const bool stepped = reference[i]._version() != reference_before[i];
      EXPECT_EQ(fused[i]._version() != before[i], stepped) << "parameter " << i << ", step " << step;
    }
  }
}

TEST(FusedAdam, RefusesSparseGradientsAsLibTorchDoes) {
  auto p = torch::zeros({4}).requires_grad_();
  auto adam = kernels::make_adam({p}, torch::optim::AdamOptions(0.1));
  p.mutable_grad() = torch::sparse_coo_tensor(torch::tensor({{1}}, torch::kLong), torch::ones({1}), {4});
  EXPECT_THROW(adam->step(), c10::Error);
}
