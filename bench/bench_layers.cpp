// Google Benchmark micro-benchmarks of the layers a CapsNet step spends its time in, at the paper's
// sizes: DigitCaps (fused routing op vs predictions() + dynamic_routing), the PrimaryCaps convolution,
// forward and forward+backward, batch 100 and batch 1; and every stage of a training step in both precisions
// beside the GEMM probe (GemmProbe, Stages). The end-to-end comparison with the plain-PyTorch peer is
// `capsnet bench`; this is for looking inside a step.
//   build/bench/capsnet_bench_layers --benchmark_filter=DigitCaps --benchmark_repetitions=3
//   build/bench/capsnet_bench_layers --benchmark_filter='GemmProbe|Stages' --benchmark_repetitions=3 \
//     --benchmark_format=json > stages.json && python3 bench/stage_table.py stages.json
//   CAPSNET_PROFILE_TRACE=trace.json build/bench/capsnet_bench_layers --benchmark_filter='Stages/stage:1/bf16:1/side:28' \
//     && python3 bench/profile_summary.py trace.json      # where PrimaryCaps' time goes, per step
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <cstdlib>
#include <functional>
#include <memory>

#include "apps/benchmark.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/kernels/fused_adam.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/kernels/spectral_conv.h"
#include "capsnet/kernels/unfolded_conv.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/nn/capsule_linear.h"
#include "capsnet/nn/functional.h"
#include "capsnet/nn/primary_caps.h"
#include "apps/runtime.h"

#if __has_include(<torch/csrc/autograd/profiler_legacy.h>)
#include <torch/csrc/autograd/profiler_legacy.h>
#define CAPSNET_LEGACY_PROFILER 1
#endif

namespace {

// Marks a bf16 benchmark skipped on a CPU without native bf16 (true: the caller returns).
bool skipped_without_bf16(benchmark::State& state, bool bf16) {
  if (!bf16 || capsnet::cpu_has_native_bf16()) return false;
  state.SkipWithError("this CPU has no native bf16");
  return true;
}

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

// A first-layer convolution (1 -> 256 channels, x without gradient) forward + weight and bias gradients, in
// the compute precision: oneDNN's direct kernel (ATen's conv2d) against one product per image over the
// patches (kernels/unfolded_conv.h). args: {batch, side, kernel, padding, bf16 (0/1), unfolded (0/1)}:
//   {100, 28, 9, 0}: the CapsNet's Conv1; {100, 40, 9, 0}: at 40x40; {32, 40, 5, 2}: the baseline CNN's conv1.
void ShallowConv(benchmark::State& state) {
  const int64_t B = state.range(0), side = state.range(1), k = state.range(2), pad = state.range(3);
  const auto dtype = state.range(4) ? torch::kBFloat16 : torch::kFloat;
  const bool unfolded = state.range(5);
  torch::manual_seed(0);
  auto w = (torch::randn({256, 1, k, k}) * 0.1).requires_grad_();  // w: [O, 1, K, K]
  auto b = torch::zeros({256}).requires_grad_();
  const auto x = torch::rand({B, 1, side, side}).to(dtype);  // x: [B, 1, S, S]
  for (auto _ : state) {
    const auto y = unfolded ? capsnet::kernels::conv2d_unfolded(x, w, b, {1, 1}, {pad, pad})
                            : torch::conv2d(x, w.to(dtype), b.to(dtype), 1, pad);  // y: [B, 256, P, P]
    y.sum().backward();
  }
  state.SetItemsProcessed(state.iterations() * B);
}

// A first-layer convolution (1 -> 256 channels) without autograd, to a dense output (what the spectral
// PrimaryCaps reads from kSpectralInferenceMinBatch on, and a pooling layer always). args {batch, side, kernel,
// padding, bf16 (0/1), path}: path 0 oneDNN's blocked kernel with weights reordered once (kernels/blocked_conv.h),
// then to_dense(); 1 ATen's conv2d on dense tensors; 2 one product per image over the patches
// (kernels/unfolded_conv.h). {., 28, 9, 0}: the CapsNet's Conv1; {., 40, 9, 0} at 40x40; {., 40, 5, 2}: the
// baseline CNN's conv1 at 40x40.
void Conv1Inference(benchmark::State& state) {
  const int64_t B = state.range(0), side = state.range(1), k = state.range(2), pad = state.range(3),
                path = state.range(5);
  const auto dtype = state.range(4) ? torch::kBFloat16 : torch::kFloat;
  if (skipped_without_bf16(state, dtype == torch::kBFloat16)) return;
  torch::manual_seed(0);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(1, 256, k).padding(pad));
  torch::NoGradGuard no_grad;
  const auto x = torch::rand({B, 1, side, side}).to(dtype);  // x: [B, 1, S, S]
  capsnet::kernels::BlockedConvWeights blocked;
  auto run = [&]() -> torch::Tensor {  // y: [B, 256, P, P], dense
    switch (path) {
      case 0: return blocked.forward(conv, x, dtype).to_dense();
      case 1: return torch::conv2d(x, conv->weight.to(dtype), conv->bias.to(dtype), 1, pad);
      default: return capsnet::kernels::conv2d_unfolded(x, conv->weight, conv->bias, {1, 1}, {pad, pad});
    }
  };
  for (int i = 0; i < 2; ++i) run();
  for (auto _ : state) benchmark::DoNotOptimize(run());
  state.SetItemsProcessed(state.iterations() * B);
}

// One stage of the paper's CapsNet training step at batch 100, in either precision, at 28x28 or with the
// MultiMNIST 36x36 and the affine experiment's 40x40 inputs (args: {stage, bf16 (0/1), side}; 36 and 40 in bf16 only), run through the model's own modules and dispatch as training runs them; and the GEMM probe
// each is compared with. Counter GFLOP/s: nominal FLOPs (apps::forward_flops: the direct convolutions'
// count) per second of forward + backward: Conv1 2x its forward (no input gradient), every other stage 3x;
// "step" is the whole step (forward, loss, backward, fused Adam), "adam" the optimizer step alone (no
// FLOP count). bench/stage_table.py turns the JSON output into docs/kernels.md's per-stage table.
enum Stage : int64_t { kConv1, kPrimary, kDigit, kDecoder, kAdam, kStep };

void Stages(benchmark::State& state) {
  const auto stage = static_cast<Stage>(state.range(0));
  const bool bf16 = state.range(1);
  if (skipped_without_bf16(state, bf16)) return;
  const auto precision = bf16 ? capsnet::Precision::kBFloat16 : capsnet::Precision::kFloat32;
  const int64_t B = 100, side = state.range(2);
  torch::manual_seed(0);
  capsnet::models::CapsNetConfig config;  // the paper's model
  config.image_size = side;
  capsnet::models::CapsNet net(config);
  net->set_precision(precision);
  auto adam = capsnet::kernels::make_adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  const auto f = capsnet::apps::forward_flops(config);
  auto images = torch::rand({B, 1, side, side});  // images: [B, 1, S, S]
  auto labels = torch::randint(10, {B}, torch::kLong);
  // Each stage's input as training hands it over, detached so that only the stage runs backward.
  auto conv1_out = capsnet::kernels::conv2d_at(net->conv1, images, precision, nullptr).detach();  // [B, 256, S - 8, S - 8]
  auto u = net->primary_caps(conv1_out, precision, /*relu_input=*/true).detach();                  // u: [B, I, 8]
  auto masked = (torch::randn({B, 160}) * 0.1).requires_grad_();                                  // [B, J * D]
  conv1_out.requires_grad_();
  u.requires_grad_();
  std::function<void()> run;
  double flops = 0;  // per image
  switch (stage) {
    case kConv1:
      run = [&] { capsnet::kernels::conv2d_at(net->conv1, images, precision, nullptr).sum().backward(); };
      flops = 2 * f.conv1;
      break;
    case kPrimary:
      run = [&] { net->primary_caps(conv1_out, precision, true).sum().backward(); };
      flops = 3 * f.primary;
      break;
    case kDigit:
      run = [&] { net->digit_caps(u).sum().backward(); };
      flops = 3 * (f.predictions + f.routing);
      break;
    case kDecoder:
      run = [&] { net->decoder(masked, precision).sum().backward(); };
      flops = 3 * f.decoder;
      break;
    case kAdam:
      for (auto& p : net->parameters()) p.mutable_grad() = torch::randn_like(p) * 1e-3;
      run = [&] { adam->step(); };
      break;
    case kStep:
      run = [&] {
        adam->zero_grad();
        auto out = net->forward(images, labels);
        net->loss(out, images, labels).total.backward();
        adam->step();
      };
      flops = 2 * f.conv1 + 3 * (f.total() - f.conv1);
      break;
  }
  for (int i = 0; i < 2; ++i) run();  // warm-up: caches, oneDNN primitives, Adam state
  for (auto _ : state) run();
  state.SetItemsProcessed(state.iterations() * B);
  if (flops > 0)
    state.counters["GFLOP/s"] =
        benchmark::Counter(flops * static_cast<double>(B) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// One stage of the paper's CapsNet inference at batch 100, 28x28, without autograd, as `capsnet bench`'s
// "infer" column and `capsnet eval` run it (CapsNet::forward: every layer's inference caches kept between
// calls, the decoder reconstructing the predicted class). args: {stage, bf16 (0/1)}; stages as Stages'
// minus Adam: Conv1 (one product per image from batch 32), PrimaryCaps (ReLU fused; spectral from batch 32 with the kept weight
// spectrum), DigitCaps (predictions + 3 routing iterations, fp32), decoder, the whole forward. Counter
// GFLOP/s: nominal forward FLOPs (apps::forward_flops) per second.
void InferStages(benchmark::State& state) {
  const auto stage = static_cast<Stage>(state.range(0));
  const bool bf16 = state.range(1);
  if (skipped_without_bf16(state, bf16)) return;
  const auto precision = bf16 ? capsnet::Precision::kBFloat16 : capsnet::Precision::kFloat32;
  const int64_t B = 100;
  torch::manual_seed(0);
  capsnet::models::CapsNetConfig config;
  capsnet::models::CapsNet net(config);
  net->set_precision(precision);
  net->eval();
  torch::NoGradGuard no_grad;
  const auto f = capsnet::apps::forward_flops(config);
  auto images = torch::rand({B, 1, 28, 28});  // images: [B, 1, 28, 28]
  capsnet::kernels::BlockedConvWeights conv1_blocked;
  auto conv1 = [&] { return capsnet::kernels::conv2d_at(net->conv1, images, precision, &conv1_blocked); };
  const std::vector<int64_t> conv1_sizes{B, config.conv1_channels, config.conv1_grid(), config.conv1_grid()};
  auto conv1_out = conv1();  // [B, 256, S - 8, S - 8], blocked where conv2d_at keeps it so
  auto u = net->primary_caps(conv1_out, precision, /*relu_input=*/true);  // u: [B, I, 8]
  auto v = net->digit_caps(u);                                           // v: [B, 10, 16]
  const auto which = capsnet::capsule_length(v).argmax(1);
  std::function<void()> run;
  double flops = 0;  // per image
  switch (stage) {
    case kConv1:
      run = [&] { benchmark::DoNotOptimize(conv1()); };
      flops = f.conv1;
      break;
    case kPrimary:
      run = [&] {
        net->primary_caps->prepare(conv1_sizes, precision);
        benchmark::DoNotOptimize(net->primary_caps(conv1_out, precision, true));
      };
      flops = f.primary;
      break;
    case kDigit:
      run = [&] { benchmark::DoNotOptimize(net->digit_caps(u)); };
      flops = f.predictions + f.routing;
      break;
    case kDecoder:
      run = [&] { benchmark::DoNotOptimize(net->decode(v, which)); };
      flops = f.decoder;
      break;
    case kStep:
      run = [&] { benchmark::DoNotOptimize(net->forward(images).lengths); };
      flops = f.total();
      break;
    case kAdam:
      state.SkipWithError("no optimizer at inference");
      return;
  }
  for (int i = 0; i < 2; ++i) run();  // warm-up: caches, oneDNN primitives
  for (auto _ : state) run();
  state.SetItemsProcessed(state.iterations() * B);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * static_cast<double>(B) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// The GEMM probe of `capsnet bench` (2048^3 matrix product) as a benchmark, so that the stages' rates are
// compared with the machine's in the same run. args: {bf16 (0/1)}.
void GemmProbe(benchmark::State& state) {
  const bool bf16 = state.range(0);
  if (skipped_without_bf16(state, bf16)) return;
  double gflops = 0;
  for (auto _ : state) gflops = capsnet::apps::gemm_gflops(bf16 ? torch::kBFloat16 : torch::kFloat);
  state.counters["GFLOP/s"] = gflops;
}

BENCHMARK(GemmProbe)->ArgNames({"bf16"})->Args({0})->Args({1})->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(Stages)
    ->ArgNames({"stage", "bf16", "side"})
    ->ArgsProduct({{kConv1, kPrimary, kDigit, kDecoder, kAdam, kStep}, {0, 1}, {28}})
    ->ArgsProduct({{kConv1, kPrimary, kDigit, kDecoder, kAdam, kStep}, {1}, {36, 40}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(Conv1Inference)
    ->ArgNames({"batch", "side", "kernel", "pad", "bf16", "path"})
    ->ArgsProduct({{32, 100, 250}, {28}, {9}, {0}, {0, 1}, {0, 1, 2}})
    ->ArgsProduct({{32, 100}, {40}, {9}, {0}, {0, 1}, {0, 1, 2}})
    ->ArgsProduct({{32, 100}, {40}, {5}, {2}, {0, 1}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(InferStages)
    ->ArgNames({"stage", "bf16"})
    ->ArgsProduct({{kConv1, kPrimary, kDigit, kDecoder, kStep}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
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
BENCHMARK(ShallowConv)
    ->ArgNames({"batch", "side", "kernel", "pad", "bf16", "unfolded"})
    ->ArgsProduct({{100}, {28}, {9}, {0}, {0, 1}, {0, 1}})
    ->ArgsProduct({{100}, {40}, {9}, {0}, {0, 1}, {0, 1}})
    ->ArgsProduct({{32}, {40}, {5}, {2}, {0, 1}, {0, 1}})
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
  // CAPSNET_PROFILE_TRACE=FILE: record the run with LibTorch's profiler (ATen ops and the kernels' named
  // scopes, e.g. spectral::forward.products) as a Chrome trace; bench/profile_summary.py FILE sums it per step.
#ifdef CAPSNET_LEGACY_PROFILER
  std::unique_ptr<torch::autograd::profiler::RecordProfile> profile;
  if (const char* trace = std::getenv("CAPSNET_PROFILE_TRACE"); trace && *trace)
    profile = std::make_unique<torch::autograd::profiler::RecordProfile>(std::string(trace));
#endif
  benchmark::RunSpecifiedBenchmarks();
#ifdef CAPSNET_LEGACY_PROFILER
  profile.reset();  // writes the trace
#endif
  benchmark::Shutdown();
  return 0;
}
