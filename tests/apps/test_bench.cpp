// capsnet bench: the in-process measurement (apps::run_benchmark) and the side-by-side CLI driver,
// including the plain-PyTorch peer (Debian's /usr/bin/python3 + python3-torch, installed by setup.sh).
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "apps/benchmark.h"
#include "cli_helpers.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::run_command;
const std::string kCli = CAPSNET_CLI;

apps::BenchOptions tiny_bench() {
  apps::BenchOptions o;
  o.model = testing::tiny_config();
  o.batch_size = 4;
  o.warmup_steps = 1;
  o.steps = 2;
  o.infer_batches = 1;
  o.latency_runs = 2;
  return o;
}

TEST(BenchmarkTest, MeasuresPositiveFiniteFiguresForBothRoutingPaths) {
  for (bool fused : {true, false}) {
    auto o = tiny_bench();
    o.fused_routing = fused;
    const auto r = apps::run_benchmark(o);
    for (double x : {r.train_img_s, r.infer_img_s, r.latency_b1_ms, r.train_peak_rss_mb}) {
      EXPECT_TRUE(std::isfinite(x)) << "fused=" << fused;
      EXPECT_GT(x, 0) << "fused=" << fused;
    }
    // The peak is reset to the current RSS just before training, so the growth can't be negative.
    EXPECT_GE(r.train_rss_growth_mb, -0.5) << "fused=" << fused;
    const auto j = r.to_json();
    EXPECT_DOUBLE_EQ(j.at("train_img_s").get<double>(), r.train_img_s);
    EXPECT_DOUBLE_EQ(j.at("latency_b1_ms").get<double>(), r.latency_b1_ms);
    EXPECT_DOUBLE_EQ(j.at("latency_b1_p90_ms").get<double>(), r.latency_b1_p90_ms);
    EXPECT_GE(r.latency_b1_p90_ms, r.latency_b1_ms) << "fused=" << fused;  // p90 of the same runs >= their median
  }
}

TEST(BenchmarkTest, QuantileIsTheNearestRank) {
  const std::vector<double> ten = {10, 1, 9, 2, 8, 3, 7, 4, 6, 5};
  EXPECT_EQ(apps::quantile(ten, 0.9), 9);  // ceil(0.9 * 10) = 9th smallest
  EXPECT_EQ(apps::quantile(ten, 0.5), 5);
  EXPECT_EQ(apps::quantile(ten, 1.0), 10);
  EXPECT_EQ(apps::quantile(ten, 0.01), 1);
  EXPECT_EQ(apps::quantile({3, 1, 2}, 0.9), 3);  // ceil(2.7) = 3rd
  EXPECT_THROW(apps::quantile({}, 0.5), c10::Error);
  EXPECT_THROW(apps::quantile({1}, 0), c10::Error);
}

TEST(BenchmarkTest, PeakRssResetsAndTracksAnAllocation) {
  apps::reset_peak_rss();
  const double before = apps::peak_rss_mb();
  {
    // 64 MB of fresh pages from the kernel (not the allocator, which may hand back pages that are already
    // resident after earlier tests in this process), touched so they are resident.
    constexpr size_t kBytes = size_t{64} << 20;
    void* block = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(block, MAP_FAILED);
    std::memset(block, 1, kBytes);
    EXPECT_GE(apps::rss_mb(), before + 50);
    EXPECT_GE(apps::peak_rss_mb(), before + 50);
    munmap(block, kBytes);
  }
  apps::reset_peak_rss();
  // After the reset the peak is the current RSS again (allocator caches may keep some of the block).
  EXPECT_NEAR(apps::peak_rss_mb(), apps::rss_mb(), 1.0);
}

TEST(BenchmarkTest, MedianOfOddAndEvenCounts) {
  EXPECT_DOUBLE_EQ(apps::median({3, 1, 2}), 2.0);
  EXPECT_DOUBLE_EQ(apps::median({4, 1, 3, 2}), 2.5);
  EXPECT_THROW(apps::median({}), c10::Error);
}

TEST(BenchmarkTest, RejectsNonPositiveCounts) {
  auto o = tiny_bench();
  o.steps = 0;
  EXPECT_THROW(apps::run_benchmark(o), c10::Error);
  o = tiny_bench();
  o.batch_size = 0;
  EXPECT_THROW(apps::run_benchmark(o), c10::Error);
}

TEST(BenchCliTest, RunsFusedReferenceAndPeerSideBySideAndWritesJsonLines) {
  testing::TempDir dir;
  const std::string jsonl = dir / "bench.jsonl";
  auto r = run_command(kCli + " bench --batch-size 2 --steps 1 --infer-batches 1 --latency-runs 1 --repeats 1" +
                       " --jsonl " + jsonl);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("fused vs peer: training"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fused vs reference: training"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fused vs peer-tuned: training"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fused vs peer-spectral: training"), std::string::npos) << r.output;

  std::ifstream in(jsonl);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  // Every peer by default, the spectral one included; the bf16 configurations too where the CPU computes bf16
  // natively.
  const auto expected = cpu_has_native_bf16()
                            ? std::vector<std::string>{"fused", "fused-bf16", "reference", "peer", "peer-tuned",
                                                       "peer-tuned-bf16", "peer-spectral", "peer-spectral-bf16"}
                            : std::vector<std::string>{"fused", "reference", "peer", "peer-tuned", "peer-spectral"};
  ASSERT_EQ(lines.size(), expected.size() + 1);  // one per configuration, then the summary
  std::vector<std::string> configs;
  for (size_t i = 0; i < expected.size(); ++i) {
    configs.push_back(lines[i].at("config").get<std::string>());
    EXPECT_EQ(lines[i].at("batch_size").get<int64_t>(), 2);
    EXPECT_GT(lines[i].at("train_img_s").get<double>(), 0);
    EXPECT_GT(lines[i].at("train_peak_rss_mb").get<double>(), 0);
  }
  EXPECT_EQ(configs, expected);
  // Every peer runs on the allocator capsnet runs on: jemalloc with capsnet's options, preloaded, said in the
  // output and the summary (glibc's malloc only where the CLI was built without jemalloc).
  const auto allocator = lines.back().at("peer_allocator").get<std::string>();
  EXPECT_NE(r.output.find("the Python peers run on capsnet's allocator: " + allocator), std::string::npos) << r.output;
  const bool jemalloc = allocator.rfind("LD_PRELOAD=", 0) == 0;
  if (jemalloc) EXPECT_NE(allocator.find("MALLOC_CONF='dirty_decay_ms:-1,oversize_threshold:0"), std::string::npos);
  for (const auto& line : lines)
    if (line.contains("config") && line.at("config").get<std::string>().rfind("peer", 0) == 0)
      EXPECT_EQ(line.at("allocator").get<std::string>(), jemalloc ? "jemalloc" : "glibc malloc") << line.dump();
  if (cpu_has_native_bf16()) {
    EXPECT_NE(r.output.find("fused-bf16 vs fused: training"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fused-bf16 vs peer-tuned-bf16: training"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("fused-bf16 vs peer-spectral-bf16: training"), std::string::npos) << r.output;
  }
  const auto& summary = lines.back();
  ASSERT_TRUE(summary.at("summary").get<bool>());
  const double fused = summary.at("median").at("fused").at("train_img_s").get<double>();
  const double peer = summary.at("median").at("peer").at("train_img_s").get<double>();
  EXPECT_NEAR(summary.at("ratios").at("fused/peer").at("train_speedup").get<double>(), fused / peer, 1e-9);
  // Achieved GFLOP/s: 3 forward passes per trained image, against the GEMM probe of the same run.
  const double gflop = summary.at("forward_gflop_per_image").get<double>();
  EXPECT_NEAR(summary.at("gflops").at("fused").at("train").get<double>(), 3 * gflop * fused, 1e-6);
  EXPECT_GT(summary.at("gemm_gflops").at("fp32").get<double>(), 0);
  EXPECT_NE(r.output.find("achieved GFLOP/s"), std::string::npos) << r.output;
}

TEST(BenchmarkTest, ForwardFlopsOfThePaperModelAddUpByHand) {
  // Conv1 2*20^2*256*81 + PrimaryCaps 2*6^2*256*(81*256) + u_hat 2*1152*10*16*8 + routing 4*1152*10*16*3
  // + decoder 2*(160*512 + 512*1024 + 1024*784).
  const double expected = 16588800.0 + 382205952.0 + 2949120.0 + 2211840.0 + 2818048.0;
  EXPECT_DOUBLE_EQ(apps::forward_flops_per_image(models::CapsNetConfig{}), expected);
  const auto stages = apps::forward_flops(models::CapsNetConfig{});
  EXPECT_DOUBLE_EQ(stages.conv1, 16588800.0);
  EXPECT_DOUBLE_EQ(stages.primary, 382205952.0);
  EXPECT_DOUBLE_EQ(stages.predictions, 2949120.0);
  EXPECT_DOUBLE_EQ(stages.routing, 2211840.0);
  EXPECT_DOUBLE_EQ(stages.decoder, 2818048.0);
  models::CapsNetConfig no_decoder;
  no_decoder.reconstruction = false;
  EXPECT_DOUBLE_EQ(apps::forward_flops_per_image(no_decoder), expected - 2818048.0);
  // The probe measures something: a small product takes positive, finite time.
  const double g = apps::gemm_gflops(torch::kFloat, 64, 2);
  EXPECT_GT(g, 0);
  EXPECT_TRUE(std::isfinite(g));
}

TEST(BenchCliTest, OnednnCountsModeCountsTheConvolutionsOfATrainingStep) {
  // fp32: Conv1's forward and weight gradient (the images need no input gradient); PrimaryCaps runs
  // through DFTs and oneDNN's sgemm (kernels/spectral_conv.h), which traces no convolution. Counted from
  // ONEDNN_VERBOSE as a difference of two traced runs.
  auto r = run_command(kCli + " bench --onednn-counts --configs fused --batch-size 2 --threads 1");
  ASSERT_EQ(r.status, 0) << r.output;
  std::istringstream lines(r.output);
  std::string line, last_json;
  while (std::getline(lines, line))
    if (!line.empty() && line.front() == '{') last_json = line;
  ASSERT_FALSE(last_json.empty()) << r.output;
  const auto j = nlohmann::json::parse(last_json);
  const auto& fused = j.at("configs").at("fused");
  const double conv = fused.at("convolution_per_step").get<double>();
  EXPECT_EQ(conv, std::round(conv)) << "a step runs whole primitives";
  EXPECT_EQ(conv, 2) << r.output;
  EXPECT_GE(fused.at("reorder_per_step").get<double>(), 0);
  EXPECT_EQ(j.at("batch_size").get<int64_t>(), 2);
}

TEST(BenchCliTest, AConfigurationRunsAtAnotherImageSideWhenNamedWithIt) {
  // fused@40: the same network on 40x40 inputs (the affine experiment's 4,608 primary capsules), measured
  // and costed at its own side beside the 28x28 one.
  const std::string jsonl = (std::filesystem::temp_directory_path() / "capsnet_bench_sides.jsonl").string();
  std::filesystem::remove(jsonl);
  auto r = run_command(kCli + " bench --configs fused,fused@40 --repeats 1 --batch-size 2 --steps 1 "
                              "--infer-batches 1 --latency-runs 1 --threads 1 --jsonl " + jsonl);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("capsnet, fused routing op, 40x40"), std::string::npos) << r.output;
  std::ifstream in(jsonl);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].at("config"), "fused");
  EXPECT_EQ(lines[0].at("image_size").get<int64_t>(), 28);
  EXPECT_EQ(lines[1].at("config"), "fused@40");
  EXPECT_EQ(lines[1].at("image_size").get<int64_t>(), 40);
  models::CapsNetConfig forty;
  forty.image_size = 40;
  const auto& gflops = lines[2].at("gflops");
  EXPECT_DOUBLE_EQ(gflops.at("fused@40").at("forward_gflop_per_image").get<double>(),
                   apps::forward_flops_per_image(forty) / 1e9);
  EXPECT_DOUBLE_EQ(gflops.at("fused").at("forward_gflop_per_image").get<double>(),
                   apps::forward_flops_per_image(models::CapsNetConfig{}) / 1e9);
  // PrimaryCaps dominates and has 12x12 instead of 6x6 outputs: about 4x the work.
  EXPECT_GT(gflops.at("fused@40").at("forward_gflop_per_image").get<double>(),
            3.5 * gflops.at("fused").at("forward_gflop_per_image").get<double>());
  std::filesystem::remove(jsonl);
  for (const std::string bad : {"fused@7", "fused@forty", "peer@40", "fused@", "tensorflow@40"})
    EXPECT_TRUE(testing::FailsSaying(testing::run_cli("bench --configs " + bad), bad.substr(0, bad.find('@')))) << bad;
  EXPECT_TRUE(testing::FailsSaying(testing::run_cli("bench --configs peer@40"), "the peers run 28x28 only"));
}

TEST(BenchCliTest, UnknownConfigurationAndMissingPythonAreClearErrors) {
  EXPECT_TRUE(testing::FailsSaying(testing::run_cli("bench --configs fused,tensorflow"), "tensorflow"));
  EXPECT_TRUE(testing::FailsSaying(testing::run_cli("bench --configs peer --python /nonexistent/python3"),
                                   "/nonexistent/python3"));
}

}  // namespace
}  // namespace capsnet
