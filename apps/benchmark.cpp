#include "apps/benchmark.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <vector>

#include "apps/runtime.h"
#include "capsnet/kernels/adam_state.h"
#include "capsnet/kernels/fused_adam.h"
#include "capsnet/train/gradients.h"

namespace capsnet::apps {
namespace {

double status_field_mb(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;  // kB
  return std::numeric_limits<double>::quiet_NaN();
}

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double median(std::vector<double> v) {
  TORCH_CHECK(!v.empty(), "median of no values");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double quantile(std::vector<double> v, double q) {
  TORCH_CHECK(!v.empty() && q > 0 && q <= 1, "quantile: values must be non-empty and q in (0, 1]");
  std::sort(v.begin(), v.end());
  const auto rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::max<size_t>(rank, 1) - 1];
}

ForwardFlops forward_flops(const models::CapsNetConfig& c) {
  const double conv1_side = static_cast<double>(c.image_size - c.conv1_kernel + 1);
  const double grid = static_cast<double>(c.primary_grid());
  const double children = static_cast<double>(c.num_primary_caps());
  const double parents = static_cast<double>(c.num_classes), dd = static_cast<double>(c.digit_dim);
  const double pixels = static_cast<double>(c.image_size * c.image_size * c.image_channels);
  ForwardFlops f;
  f.conv1 = 2 * conv1_side * conv1_side * static_cast<double>(c.conv1_channels) *
            static_cast<double>(c.conv1_kernel * c.conv1_kernel * c.image_channels);
  f.primary = 2 * grid * grid * static_cast<double>(c.primary_types * c.primary_dim) *
              static_cast<double>(c.primary_kernel * c.primary_kernel * c.conv1_channels);
  f.predictions = 2 * children * parents * dd * static_cast<double>(c.primary_dim);
  // Each iteration: s_j = sum_i c_ij u_hat_j|i and the agreement u_hat_j|i . v_j.
  f.routing = 4 * children * parents * dd * static_cast<double>(c.routing_iterations);
  f.decoder = c.reconstruction ? 2 * (parents * dd * 512 + 512 * 1024 + 1024 * pixels) : 0;
  return f;
}

double forward_flops_per_image(const models::CapsNetConfig& c) { return forward_flops(c).total(); }

double gemm_gflops(torch::ScalarType dtype, int64_t n, int repeats) {
  torch::NoGradGuard no_grad;
  // The probe is the machine's peak on all of this run's threads: fp32 mm runs on OpenBLAS, which
  // the runtime otherwise holds to 1 thread (apps/runtime.h).
  const int blas_before = set_blas_threads(at::get_num_threads());
  auto a = torch::randn({n, n}).to(dtype), b = torch::randn({n, n}).to(dtype);
  auto c = torch::mm(a, b);  // warm-up: packing buffers, thread pool
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < repeats; ++i) best = std::min(best, seconds([&] { c = torch::mm(a, b); }));
  if (blas_before > 0) set_blas_threads(blas_before);
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / best / 1e9;
}

double rss_mb() { return status_field_mb("VmRSS"); }
double peak_rss_mb() { return status_field_mb("VmHWM"); }
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

nlohmann::json BenchResult::to_json() const {
  return {{"train_img_s", train_img_s},
          {"infer_img_s", infer_img_s},
          {"latency_b1_ms", latency_b1_ms},
          {"latency_b1_p90_ms", latency_b1_p90_ms},
          {"train_peak_rss_mb", train_peak_rss_mb},
          {"train_rss_growth_mb", train_rss_growth_mb}};
}

BenchResult run_benchmark(const BenchOptions& o) {
  TORCH_CHECK(o.batch_size > 0 && o.steps > 0 && o.infer_batches > 0 && o.latency_runs > 0 && o.warmup_steps >= 0,
              "benchmark: batch size, steps, inference batches and latency runs must be positive");
  torch::manual_seed(o.seed);
  models::CapsNet model(o.model);
  model->set_fused_routing(o.fused_routing);
  model->set_precision(o.precision);
  const auto adam = kernels::make_adam(model->parameters(), torch::optim::AdamOptions(1e-3));  // as the loop
  auto& optimizer = *adam;
  kernels::allocate_adam_state(optimizer);  // as the training loop does
  const auto& c = o.model;
  // images: [B, C, H, W] in [0, 1); labels: [B]
  auto images = torch::rand({o.batch_size, c.image_channels, c.image_size, c.image_size});
  auto labels = torch::randint(c.num_classes, {o.batch_size}, torch::kLong);

  auto train_step = [&] {
    train::clear_grads(optimizer);
    auto out = model->forward(images, labels);
    auto loss = model->loss(out, images, labels);
    loss.total.backward();
    optimizer.step();
    return loss.total.item<double>();  // syncs, as a real training loop does
  };

  BenchResult r;
  const double rss_before = rss_mb();
  reset_peak_rss();
  model->train();
  for (int64_t i = 0; i < o.warmup_steps; ++i) train_step();
  std::vector<double> step_s;
  for (int64_t i = 0; i < o.steps; ++i) step_s.push_back(seconds(train_step));
  r.train_peak_rss_mb = peak_rss_mb();
  r.train_rss_growth_mb = r.train_peak_rss_mb - rss_before;
  r.train_img_s = o.batch_size / median(step_s);

  model->eval();
  torch::NoGradGuard no_grad;
  auto predict = [&](const torch::Tensor& x) { return model->forward(x).lengths.argmax(1); };
  predict(images);  // warm-up
  std::vector<double> infer_s;
  for (int64_t i = 0; i < o.infer_batches; ++i) infer_s.push_back(seconds([&] { predict(images); }));
  r.infer_img_s = o.batch_size / median(infer_s);

  auto one = images.slice(0, 0, 1).clone();
  for (int i = 0; i < 3; ++i) predict(one);
  std::vector<double> lat_s;
  for (int64_t i = 0; i < o.latency_runs; ++i) lat_s.push_back(seconds([&] { predict(one); }));
  r.latency_b1_ms = 1000 * median(lat_s);
  r.latency_b1_p90_ms = 1000 * quantile(lat_s, 0.9);
  return r;
}

}  // namespace capsnet::apps
