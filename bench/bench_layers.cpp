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

// args: {batch, fused (0/1), backward (0/1), input capsules (1152: 28x28 images; 4608: 40x40)}
void DigitCaps(benchmark::State& state) {
  const int64_t B = state.range(0), I = state.range(3);
  const bool fused = state.range(1), backward = state.range(2);
  torch::manual_seed(0);
  CapsuleLinear layer(CapsuleLinearOptions(I, 8, 10, 16).routing({3, true, fused}));
  auto u = torch::randn({B, I, 8}).mul_(0.1).requires_grad_(backward);  // u: [B, I, Din]
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

// args: {batch, backward (0/1), input side (20: 28x28 images; 32: 40x40)}; the input gradient is needed
// too (it trains Conv1). fp32.
void PrimaryCapsConv(benchmark::State& state) {
  const int64_t B = state.range(0);
  const bool backward = state.range(1);
  torch::manual_seed(0);
  const int64_t side = state.range(2);
  capsnet::nn::PrimaryCaps layer(capsnet::nn::PrimaryCapsOptions(256, 32, 8));
  auto x = torch::rand({B, 256, side, side}).requires_grad_(backward);  // x: [B, 256, S, S]
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

// A 256 -> 256 channel convolution, bf16 input, fp32 weights, forward and backward (input and weight
// gradients): oneDNN's direct convolution against the DFT form (kernels/spectral_conv.h) on the
// zero-padded input. args: {batch, side, kernel, stride, padding, spectral (0/1)}:
//   {32, 40, 5, 1, 2}: the unpooled baseline CNN's conv2 at 40x40; {32, 20, 5, 1, 2}: the pooled one's;
//   {100, 20, 9, 2, 0}: PrimaryCaps at 28x28; {100, 32, 9, 2, 0}: PrimaryCaps at 40x40.
void ConvPathsBf16(benchmark::State& state) {
  const int64_t B = state.range(0), side = state.range(1), k = state.range(2), stride = state.range(3),
                pad = state.range(4);
  const bool spectral = state.range(5);
  torch::manual_seed(0);
  auto w = (torch::randn({256, 256, k, k}) * 0.02).requires_grad_();  // w: [O, C, K, K]
  auto b = torch::zeros({256}).requires_grad_();
  auto x = torch::randn({B, 256, side, side}).to(torch::kBFloat16).requires_grad_();  // x: [B, C, S, S]
  for (auto _ : state) {
    torch::Tensor y;  // y: [B, O, P, P]
    if (spectral)
      y = capsnet::kernels::conv2d_spectral(torch::constant_pad_nd(x, {pad, pad, pad, pad}), w, b,
                                            {stride, stride});
    else
      y = torch::conv2d(x, w.to(torch::kBFloat16), b.to(torch::kBFloat16), stride, pad);
    y.sum().backward();
  }
  state.SetItemsProcessed(state.iterations() * B);
}

BENCHMARK(DigitCaps)
    ->ArgNames({"batch", "fused", "backward", "inputs"})
    ->ArgsProduct({{1, 100}, {1, 0}, {0, 1}, {1152, 4608}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(ConvPathsBf16)
    ->ArgNames({"batch", "side", "kernel", "stride", "pad", "spectral"})
    ->Args({32, 40, 5, 1, 2, 0})
    ->Args({32, 40, 5, 1, 2, 1})
    ->Args({32, 20, 5, 1, 2, 0})
    ->Args({32, 20, 5, 1, 2, 1})
    ->Args({100, 20, 9, 2, 0, 0})
    ->Args({100, 20, 9, 2, 0, 1})
    ->Args({100, 32, 9, 2, 0, 0})
    ->Args({100, 32, 9, 2, 0, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(PrimaryCapsConv)
    ->ArgNames({"batch", "backward", "side"})
    ->ArgsProduct({{1, 100}, {0, 1}, {20, 32}})
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
