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
  nn::Precision precision = nn::Precision::kFloat32;  // compute type of the convolutions and decoder
  int64_t batch_size = 100;
  int64_t warmup_steps = 2;
  int64_t steps = 10;          // timed training steps; the median step time gives train_img_s
  int64_t infer_batches = 5;   // timed no-grad forward passes at batch_size
  int64_t latency_runs = 30;   // timed batch-1 forward passes
  uint64_t seed = 1;
};

struct BenchResult {
  double train_img_s = 0, infer_img_s = 0, latency_b1_ms = 0;
  double train_peak_rss_mb = 0;    // VmHWM over the training phase (whole process)
  double train_rss_growth_mb = 0;  // that peak minus the RSS before the first step
  nlohmann::json to_json() const;
};

/// Trains (Adam, margin + reconstruction loss) and then infers on random images with random labels.
BenchResult run_benchmark(const BenchOptions& options);

/// Median of the values (mean of the middle two for an even count); throws on an empty list.
double median(std::vector<double> values);

/// Current / peak resident set of this process in MiB (from /proc/self/status; NaN if unavailable).
double rss_mb();
double peak_rss_mb();
/// Resets the peak (VmHWM) to the current RSS so the next phase is measured alone (Linux >= 4.0).
void reset_peak_rss();

}  // namespace capsnet::apps
