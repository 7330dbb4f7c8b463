// Google Benchmark micro-benchmarks of the layers a CapsNet step spends its time in, at the paper's
// sizes: DigitCaps (fused routing op vs predictions() + dynamic_routing), the PrimaryCaps convolution,
// forward and forward+backward, batch 100 and batch 1. The end-to-end comparison with the
// plain-PyTorch peer is `capsnet bench`; this is for looking inside a step.
//   build/bench/capsnet_bench_layers --benchmark_filter=DigitCaps --benchmark_repetitions=3
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "capsnet/kernels/spectral_conv.h"
#include "capsnet/nn/capsule_linear.h"
#include "capsnet/nn/primary_caps.h"
#include "apps/runtime.h"

namespace {

using capsnet::nn::CapsuleLinear;
using capsnet::nn::CapsuleLinearOptions;

// args: {batch, fused (0/1), backward (0/1)}
void DigitCaps(benchmark::State& state) {
  const int64_t B = state.range(0);
  const bool fused = state.range(1), backward = state.range(2);
  torch::manual_seed(0);
  CapsuleLinear layer(CapsuleLinearOptions(1152, 8, 10, 16).routing({3, true, fused}));
  auto u = torch::randn({B, 1152, 8}).mul_(0.1).requires_grad_(backward);  // u: [B, I, Din]
  for (auto _ : state) {
    if (backward) {
      auto v = layer(u);  // v: [B, J, D]
      v.sum().backward();
    } else {
      torch::NoGradGuard no_grad;
      benchmark::DoNotOptimize(layer(u));
    }
  }
  state.SetItemsProcessed(state.iterations() * B);
}

// args: {batch, backward (0/1)}; the input gradient is needed too (it trains Conv1).
void PrimaryCapsConv(benchmark::State& state) {
  const int64_t B = state.range(0);
  const bool backward = state.range(1);
  torch::manual_seed(0);
  capsnet::nn::PrimaryCaps layer(capsnet::nn::PrimaryCapsOptions(256, 32, 8));
  auto x = torch::rand({B, 256, 20, 20}).requires_grad_(backward);  // x: [B, 256, 20, 20]
  for (auto _ : state) {
    if (backward) {
      layer(x).sum().backward();
    } else {
      torch::NoGradGuard no_grad;
      benchmark::DoNotOptimize(layer(x));
    }
  }
  state.SetItemsProcessed(state.iterations() * B);
}

// The baseline CNN's 5x5 "same" convolution 256 -> 256 channels, bf16 input, fp32 weights, forward and
// backward (input and weight gradients), batch 32: oneDNN's direct convolution (path 0) against the DFT
// form on the zero-padded input (path 1). args: {side (40: the unpooled CNN at 40x40; 20: the pooled
// CNN's conv2), path}.
void CnnConv5x5Same(benchmark::State& state) {
  const int64_t B = 32, side = state.range(0);
  const bool spectral = state.range(1);
  torch::manual_seed(0);
  auto w = (torch::randn({256, 256, 5, 5}) * 0.02).requires_grad_();  // w: [O, C, 5, 5]
  auto b = torch::zeros({256}).requires_grad_();
  auto x = torch::randn({B, 256, side, side}).to(torch::kBFloat16).requires_grad_();  // x: [B, C, S, S]
  for (auto _ : state) {
    torch::Tensor y;  // y: [B, O, S, S]
    if (spectral)
      y = capsnet::kernels::conv2d_spectral(torch::constant_pad_nd(x, {2, 2, 2, 2}), w, b, {1, 1});
    else
      y = torch::conv2d(x, w.to(torch::kBFloat16), b.to(torch::kBFloat16), 1, 2);
    y.sum().backward();
  }
  state.SetItemsProcessed(state.iterations() * B);
}

BENCHMARK(DigitCaps)
    ->ArgNames({"batch", "fused", "backward"})
    ->ArgsProduct({{1, 100}, {1, 0}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(CnnConv5x5Same)
    ->ArgNames({"side", "spectral"})
    ->ArgsProduct({{20, 40}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(PrimaryCapsConv)
    ->ArgNames({"batch", "backward"})
    ->ArgsProduct({{1, 100}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  capsnet::apps::configure_runtime(argc, argv);  // all cores, as the CLI runs
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
