#pragma once
// Speed and memory of one CapsNet configuration on synthetic data: what `capsnet bench` runs in each
// worker process (one process per configuration, so peak-RSS figures do not mix).

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "capsnet/models/capsnet.h"

namespace capsnet::apps {

struct BenchOptions {
  models::CapsNetConfig model;
  bool fused_routing = true;  // false: composite (reference-style) routing
  Precision precision = Precision::kFloat32;  // compute type of the convolutions and decoder
  int64_t batch_size = 100;
  int64_t warmup_steps = 2;
  int64_t steps = 10;          // timed training steps; the median step time gives train_img_s
  int64_t infer_batches = 5;   // timed no-grad forward passes at batch_size
  int64_t latency_runs = 30;   // timed batch-1 forward passes
  uint64_t seed = 1;
};

struct BenchResult {
  double train_img_s = 0, infer_img_s = 0, latency_b1_ms = 0;
  double latency_b1_p90_ms = 0;    // 90th percentile (nearest rank) of the batch-1 forward passes
  double train_peak_rss_mb = 0;    // VmHWM over the training phase (whole process)
  double train_rss_growth_mb = 0;  // that peak minus the RSS before the first step
  nlohmann::json to_json() const;
};

/// Trains (Adam, margin + reconstruction loss) and then infers on random images with random labels.
BenchResult run_benchmark(const BenchOptions& options);

/// Floating-point operations (2 per multiply-add) of one image's forward pass through a CapsNet of
/// `config`: Conv1, the PrimaryCaps conv, the predictions u_hat, r routing iterations (weighted sum and
/// agreement) and the decoder. A training step costs about 3x this (the backward pass computes input and
/// weight gradients: two forward passes' worth); the squash, softmax and losses are negligible.
double forward_flops_per_image(const models::CapsNetConfig& config);

/// forward_flops_per_image by stage (FLOPs of one image's forward pass through each).
struct ForwardFlops {
  double conv1 = 0, primary = 0, predictions = 0, routing = 0, decoder = 0;
  double total() const { return conv1 + primary + predictions + routing + decoder; }
};
ForwardFlops forward_flops(const models::CapsNetConfig& config);

/// Sustained GFLOP/s of an n x n x n matrix product in `dtype` (kFloat or kBFloat16) on this process's
/// threads, best of `repeats` after one warm-up: the machine's practical peak that `capsnet bench`
/// reports its step throughput against.
double gemm_gflops(torch::ScalarType dtype, int64_t n = 2048, int repeats = 5);

/// Median of the values (mean of the middle two for an even count); throws on an empty list.
double median(std::vector<double> values);
/// Nearest-rank quantile, q in (0, 1]: the smallest value with at least q of the values at or below it.
double quantile(std::vector<double> values, double q);

/// Current / peak resident set of this process in MiB (from /proc/self/status; NaN if unavailable).
double rss_mb();
double peak_rss_mb();
/// Resets the peak (VmHWM) to the current RSS so the next phase is measured alone (Linux >= 4.0).
void reset_peak_rss();

}  // namespace capsnet::apps
