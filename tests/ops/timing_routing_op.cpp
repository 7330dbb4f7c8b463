// Timing program for docs/kernels.md (not a test): the fused routing operator vs the ATen formulation
// capsnet::dynamic_routing, at the paper's DigitCaps sizes by default.
//
//   capsnet_ops_timing [--threads 2] [--reps 7] [--B 100] [--I 1152] [--J 10] [--D 16] [--Din 8] [--r 3]
//                      [--case NAME]
// Cases (float32, full gradient through routing, median of --reps runs after one warm-up run):
//   fused        capsnet::ops::capsule_routing(u, W)            (u_hat never stored)
//   aten         capsnet::dynamic_routing(layer->predictions(u)) (what CapsuleLinear::forward does)
//   fused_pred   capsnet::ops::routing_from_predictions(u_hat)  (u_hat given)
//   aten_pred    capsnet::dynamic_routing(u_hat)                (u_hat given)
// "fwd" runs under NoGradGuard; "fwd+bwd" is forward with autograd plus backward of sum(v * R).
// With --case NAME only that case runs, in a process whose setup peak is below the case's own, and the
// growth of the peak RSS (ru_maxrss) over the case's runs is printed: run each case in its own process.
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "apps/runtime.h"
#include "capsnet/nn/capsule_linear.h"
#include "capsnet/nn/functional.h"
#include "capsnet/ops/routing.h"

namespace {

double median_ms(const std::function<void()>& fn, int reps) {
  fn();  // warm-up
  std::vector<double> ms;
  for (int k = 0; k < reps; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double max_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

struct Problem {
  int64_t B, I, J, D, Din, r;
  capsnet::nn::CapsuleLinear layer{nullptr};
  torch::Tensor u, u_hat, R;  // u: [B, I, Din]; u_hat: [B, I, J, D] (only if needed); R: [B, J, D]

  Problem(int64_t B_, int64_t I_, int64_t J_, int64_t D_, int64_t Din_, int64_t r_, bool with_u_hat)
      : B(B_), I(I_), J(J_), D(D_), Din(Din_), r(r_) {
    layer = capsnet::nn::CapsuleLinear(capsnet::nn::CapsuleLinearOptions(I, Din, J, D).routing({r}));
    u = capsnet::squash(torch::randn({B, I, Din})).set_requires_grad(true);
    // Random predictions of the right scale, allocated once (no [B, I, J, D] temporary in the setup).
    if (with_u_hat) u_hat = torch::randn({B, I, J, D}).mul_(0.03).set_requires_grad(true);
    R = torch::randn({B, J, D});
  }

  torch::Tensor run(const std::string& name) {
    capsnet::RoutingOptions options;
    options.iterations = r;
    if (name == "fused") return capsnet::ops::capsule_routing(u, layer->weight, r, true);
    if (name == "aten") return capsnet::dynamic_routing(layer->predictions(u), options);
    if (name == "fused_pred") return capsnet::ops::routing_from_predictions(u_hat, r, true);
    if (name == "aten_pred") return capsnet::dynamic_routing(u_hat, options);
    std::fprintf(stderr, "unknown case %s\n", name.c_str());
    std::exit(2);
  }

  void forward_backward(const std::string& name) {
    for (auto* leaf : {&u, &u_hat, &layer->weight})
      if (leaf->defined()) leaf->mutable_grad() = torch::Tensor();
    (run(name) * R).sum().backward();
  }
};

}  // namespace

int main(int argc, char** argv) {
  capsnet::apps::configure_runtime(argc, argv);
  // The timing program (not the library) reads the environment: CAPSNET_OPS_CPU_ISA=baseline|avx2|avx512
  // caps the kernels' instruction set, CAPSNET_OPS_CPU_KERNEL=per_example|example_lanes forces a layout.
  if (const char* isa = std::getenv("CAPSNET_OPS_CPU_ISA")) {
    const std::string v = isa;
    capsnet::ops::set_cpu_isa(v == "baseline" ? capsnet::ops::CpuIsa::baseline
                              : v == "avx2"   ? capsnet::ops::CpuIsa::avx2
                                              : capsnet::ops::CpuIsa::avx512);
  }
  if (const char* kernel = std::getenv("CAPSNET_OPS_CPU_KERNEL"))
    capsnet::ops::set_cpu_kernel(std::string(kernel) == "per_example" ? capsnet::ops::CpuKernel::per_example
                                                                      : capsnet::ops::CpuKernel::example_lanes);
  // CAPSNET_OPS_PREDICTION_CACHE_BYTES=N caps the forward's prediction cache (0: off).
  if (const char* bytes = std::getenv("CAPSNET_OPS_PREDICTION_CACHE_BYTES"))
    capsnet::ops::set_prediction_cache_bytes(std::atoll(bytes));
  int threads = 2, reps = 7;
  int64_t B = 100, I = 1152, J = 10, D = 16, Din = 8, r = 3;
  std::string only;
  for (int k = 1; k + 1 < argc; k += 2) {
    const std::string key = argv[k];
    const char* value = argv[k + 1];
    if (key == "--threads")
      threads = std::atoi(value);
    else if (key == "--reps")
      reps = std::atoi(value);
    else if (key == "--B")
      B = std::atoll(value);
    else if (key == "--I")
      I = std::atoll(value);
    else if (key == "--J")
      J = std::atoll(value);
    else if (key == "--D")
      D = std::atoll(value);
    else if (key == "--Din")
      Din = std::atoll(value);
    else if (key == "--r")
      r = std::atoll(value);
    else if (key == "--case")
      only = value;
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      return 2;
    }
  }
  capsnet::apps::set_threads(threads);
  torch::manual_seed(0);
  const std::vector<std::string> names = only.empty()
                                             ? std::vector<std::string>{"fused", "aten", "fused_pred", "aten_pred"}
                                             : std::vector<std::string>{only};
  const bool need_u_hat =
      std::any_of(names.begin(), names.end(), [](const auto& n) { return n.find("pred") != std::string::npos; });

  // Touch every code path once on a tiny problem, so that the RSS growth below is data, not code pages.
  {
    Problem tiny(2, 3, 2, 2, 2, r, need_u_hat);
    for (const auto& name : names) tiny.forward_backward(name);
  }
  Problem p(B, I, J, D, Din, r, need_u_hat);

  std::printf("B=%lld I=%lld J=%lld D=%lld Din=%lld r=%lld threads=%d reps=%d float32, median ms\n",
              static_cast<long long>(B), static_cast<long long>(I), static_cast<long long>(J),
              static_cast<long long>(D), static_cast<long long>(Din), static_cast<long long>(r), threads, reps);
  std::printf("%-11s %10s %10s %s\n", "case", "fwd", "fwd+bwd", only.empty() ? "" : "peak RSS growth (MB)");
  for (const auto& name : names) {
    const double rss0 = max_rss_mb();
    const double fwd = median_ms(
        [&] {
          torch::NoGradGuard no_grad;
          p.run(name);
        },
        reps);
    const double fwd_bwd = median_ms([&] { p.forward_backward(name); }, reps);
    if (only.empty())
      std::printf("%-11s %10.1f %10.1f\n", name.c_str(), fwd, fwd_bwd);
    else
      std::printf("%-11s %10.1f %10.1f %.1f\n", name.c_str(), fwd, fwd_bwd, max_rss_mb() - rss0);
  }
  return 0;
}
