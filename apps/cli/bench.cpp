// capsnet bench: our CapsNet with the fused routing op, with composite (reference-style) routing, and two
// plain-PyTorch peers (bench/peer_capsnet.py, naive; bench/peer_tuned.py, the fastest eager formulation we
// know, fp32 and bf16 autocast; bench/peer_spectral.py, our PrimaryCaps maths in Python), run side by side in
// one invocation, interleaved, each measurement in a fresh process so peak memory is its own, every one on
// capsnet's allocator (jemalloc with its options, preloaded into the peers). Prints medians and ratios; JSON lines.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

#include "apps/benchmark.h"
#include "capsnet/train/json_input.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

#ifndef CAPSNET_SOURCE_DIR
#define CAPSNET_SOURCE_DIR "."
#endif

namespace capsnet::apps::cli {
namespace {

using apps::median;

std::vector<std::string> default_configs();

struct Flags {
  std::vector<std::string> configs = default_configs();
  int repeats = 3;
  int64_t batch_size = 100, steps = 10, infer_batches = 5, latency_runs = 30, routing_iters = 3;
  std::string python = "/usr/bin/python3";
  std::string peer_script = std::string(CAPSNET_SOURCE_DIR) + "/bench/peer_capsnet.py";
  std::string tuned_peer_script = std::string(CAPSNET_SOURCE_DIR) + "/bench/peer_tuned.py";
  std::string spectral_peer_script = std::string(CAPSNET_SOURCE_DIR) + "/bench/peer_spectral.py";
  std::string jsonl;
  std::string worker;  // internal: run one configuration in this process and print one JSON line
  bool onednn_counts = false;
  int threads = 0;
  int64_t image_size = 28;  // internal: the worker's image side
};

const std::map<std::string, std::string> kDescriptions = {
    {"fused", "capsnet, fused routing op"},
    {"fused-bf16", "capsnet, fused routing op, bf16 convs + decoder"},
    {"reference", "capsnet, composite routing (u_hat materialised)"},
    {"peer", "plain PyTorch peer (Python, eager)"},
    {"peer-tuned", "tuned plain PyTorch peer (Python, eager)"},
    {"peer-tuned-bf16", "tuned plain PyTorch peer, bf16 autocast"},
    {"peer-spectral", "spectral plain PyTorch peer (PrimaryCaps through DFTs, as capsnet)"},
    {"peer-spectral-bf16", "spectral plain PyTorch peer, bf16 spectra and products"}};

const std::vector<std::string> kConfigs = {"fused",      "fused-bf16",      "reference",     "peer",
                                           "peer-tuned", "peer-tuned-bf16", "peer-spectral", "peer-spectral-bf16"};

bool is_peer(const std::string& config) { return config.rfind("peer", 0) == 0; }

// A configuration may name another image side as "fused-bf16@40" (capsnet's configurations only; the peers
// are written for 28x28): the same network on 40x40 inputs, e.g. the affine experiment's 4,608 primary
// capsules or the STN experiment's 42x42 model.
constexpr int64_t kDefaultSide = 28;

std::string base_config(const std::string& config) { return config.substr(0, config.find('@')); }

int64_t config_side(const std::string& config) {
  const auto at = config.find('@');
  return at == std::string::npos ? kDefaultSide : std::stoll(config.substr(at + 1));
}

std::string describe_config(const std::string& config) {
  const int64_t side = config_side(config);
  return kDescriptions.at(base_config(config)) + (side == kDefaultSide ? "" : fmt::format(", {0}x{0}", side));
}

bool is_bf16_config(const std::string& config) {
  const auto base = base_config(config);
  return base.size() > 5 && base.compare(base.size() - 5, 5, "-bf16") == 0;
}

// Every configuration, the strongest peer (spectral) included; the bf16 ones only where the CPU computes bf16
// natively (docs/kernels.md).
std::vector<std::string> default_configs() {
  std::vector<std::string> configs;
  for (const auto& config : kConfigs)
    if (cpu_has_native_bf16() || !is_bf16_config(config)) configs.push_back(config);
  return configs;
}

// "" when `config` is a configuration bench can run, else why not.
std::string check_config(const std::string& config) {
  const auto base = base_config(config);
  if (std::find(kConfigs.begin(), kConfigs.end(), base) == kConfigs.end())
    return fmt::format("{} is not one of {}", base, fmt::join(kConfigs, ", "));
  if (base.size() == config.size()) return "";
  const std::string side = config.substr(base.size() + 1);
  if (is_peer(base)) return fmt::format("{}: the peers run 28x28 only", config);
  if (side.empty() || side.size() > 3 || side.find_first_not_of("0123456789") != std::string::npos ||
      std::stoll(side) < 20 || std::stoll(side) > 256)
    return fmt::format("{}: the side after @ must be a whole number of pixels in 20..256", config);
  return "";
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

std::string self_exe() {
  std::array<char, 4096> buf{};
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) throw std::runtime_error("bench: cannot find this executable (/proc/self/exe)");
  return std::string(buf.data(), n);
}

}  // namespace
}  // namespace capsnet::apps::cli

// jemalloc's options as this executable compiled them in (apps/jemalloc_conf.cpp); a null address where it was
// built without jemalloc.
extern "C" {
extern const char* malloc_conf __attribute__((weak));
}

namespace capsnet::apps::cli {
namespace {

// The allocator this process runs on, as environment settings for the Python peers, so that every
// configuration runs on the same one: jemalloc preloaded with capsnet's options (and $MALLOC_CONF's, which
// override them in both). Without it the naive peer page-faults its large temporaries back in every step
// (2-core Zen 5 VM, 2026-12-01: 16 img/s training with glibc's malloc, 125 with jemalloc). Empty when this
// executable has no jemalloc. Read once: the process's mappings and environment do not change.
const std::string& peer_allocator_env() {
  static const std::string env = [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
      const auto path = line.find('/');
      if (path == std::string::npos || line.find("/libjemalloc", path) == std::string::npos) continue;
      std::string conf = &malloc_conf != nullptr && malloc_conf != nullptr ? malloc_conf : "";
      if (const char* user = std::getenv("MALLOC_CONF"); user != nullptr && *user != '\0')
        conf += (conf.empty() ? "" : ",") + std::string(user);
      return "LD_PRELOAD=" + shell_quote(line.substr(path)) + " MALLOC_CONF=" + shell_quote(conf);
    }
    return std::string();
  }();
  return env;
}

// Runs a command, passing its stderr through; returns its stdout. Throws when it fails.
std::string run_capture(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  if (!pipe) throw std::runtime_error("bench: cannot start: " + command);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe.get())) > 0) out.append(buf.data(), n);
  const int status = pclose(pipe.release());
  if (status != 0) throw std::runtime_error(fmt::format("bench: worker failed (exit status {}): {}", status, command));
  return out;
}

// The last JSON line a worker printed on stdout.
nlohmann::json last_json_line(const std::string& out, const std::string& command) {
  std::istringstream lines(out);
  std::string line, last_json;
  while (std::getline(lines, line))
    if (!line.empty() && line.front() == '{') last_json = line;
  if (last_json.empty()) throw std::runtime_error("bench: worker printed no result: " + command);
  return train::parse_json(last_json, "bench: the worker's result (" + command + ")");
}

nlohmann::json run_worker(const std::string& command) { return last_json_line(run_capture(command), command); }

std::string worker_command(const Flags& f, const std::string& config) {
  const std::string sizes = fmt::format(" --batch-size {} --steps {} --infer-batches {} --latency-runs {}",
                                        f.batch_size, f.steps, f.infer_batches, f.latency_runs);
  const std::string threads = fmt::format(" --threads {}", at::get_num_threads());
  const std::string& allocator = peer_allocator_env();
  const std::string python = allocator + (allocator.empty() ? "" : " ") + shell_quote(f.python);
  if (config == "peer")
    return python + " " + shell_quote(f.peer_script) + sizes + threads +
           fmt::format(" --routing-iters {}", f.routing_iters);
  if (config.rfind("peer-tuned", 0) == 0 || config.rfind("peer-spectral", 0) == 0) {
    const bool bf16 = is_bf16_config(config);
    const auto& script = config.rfind("peer-tuned", 0) == 0 ? f.tuned_peer_script : f.spectral_peer_script;
    return python + " " + shell_quote(script) + sizes + threads +
           fmt::format(" --routing-iters {} --precision {}", f.routing_iters, bf16 ? "bf16" : "fp32");
  }
  return shell_quote(self_exe()) + " bench --worker " + base_config(config) + sizes + threads +
         fmt::format(" --routing-iters {} --image-size {}", f.routing_iters, config_side(config));
}

// oneDNN primitive executions counted from ONEDNN_VERBOSE=1 lines ("onednn_verbose,exec,cpu,KIND,
// IMPL,...,TIME_MS"; "dnnl_verbose" in older oneDNN).
struct OnednnTally {
  std::map<std::string, int64_t> count;  // primitive kind -> executions
  std::map<std::string, double> ms;      // primitive kind -> summed execution time
};

OnednnTally tally_onednn_verbose(const std::string& out) {
  OnednnTally t;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("_verbose,exec,") == std::string::npos) continue;
    std::vector<std::string> fields;
    std::istringstream in(line);
    for (std::string field; std::getline(in, field, ',');) fields.push_back(field);
    if (fields.size() < 5) continue;
    const std::string& kind = fields[3];
    ++t.count[kind];
    try {
      t.ms[kind] += std::stod(fields.back());
    } catch (const std::exception&) {
    }
  }
  return t;
}

// Per training step: the same worker traced with 2 and 2 + k timed steps (same warm-up, inference and
// latency runs), so the difference is k training steps and nothing else.
int run_onednn_counts(const Flags& f) {
  constexpr int64_t kShort = 2, kLong = 6;
  std::cout << fmt::format("oneDNN primitive executions per training step (ONEDNN_VERBOSE=1, batch {}, "
                           "difference of {} and {} timed steps):\n",
                           f.batch_size, kLong, kShort);
  std::cout << fmt::format("{:<16} {:>14} {:>10} {:>12} {:>10} {:>12}\n", "configuration", "conv / step",
                           "conv ms", "reorder / step", "reorder ms", "other / step");
  nlohmann::json summary = {{"onednn_counts", true}, {"batch_size", f.batch_size}};
  for (const auto& config : f.configs) {
    if (is_peer(config)) continue;  // Python peers: run them under ONEDNN_VERBOSE=1 by hand
    auto traced = [&](int64_t steps) {
      Flags g = f;
      g.steps = steps;
      g.infer_batches = 1;
      g.latency_runs = 1;
      return tally_onednn_verbose(run_capture("ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 " + worker_command(g, config)));
    };
    const OnednnTally a = traced(kShort), b = traced(kLong);
    auto per_step = [&](const std::map<std::string, int64_t>& ca, const std::map<std::string, int64_t>& cb,
                        const std::string& kind) {
      const auto ia = ca.find(kind), ib = cb.find(kind);
      return double((ib == cb.end() ? 0 : ib->second) - (ia == ca.end() ? 0 : ia->second)) / (kLong - kShort);
    };
    auto ms_per_step = [&](const std::string& kind) {
      const auto ia = a.ms.find(kind), ib = b.ms.find(kind);
      return ((ib == b.ms.end() ? 0 : ib->second) - (ia == a.ms.end() ? 0 : ia->second)) / (kLong - kShort);
    };
    double other = 0;
    nlohmann::json other_kinds = nlohmann::json::object();
    for (const auto& [kind, n] : b.count)
      if (kind != "convolution" && kind != "reorder") {
        other += per_step(a.count, b.count, kind);
        other_kinds[kind] = per_step(a.count, b.count, kind);
      }
    const double conv = per_step(a.count, b.count, "convolution"), reorder = per_step(a.count, b.count, "reorder");
    summary["configs"][config] = {{"convolution_per_step", conv}, {"convolution_ms_per_step", ms_per_step("convolution")},
                                  {"reorder_per_step", reorder}, {"reorder_ms_per_step", ms_per_step("reorder")},
                                  {"other_per_step", other}, {"other_kinds_per_step", other_kinds}};
    std::cout << fmt::format("{:<16} {:>14.1f} {:>10.1f} {:>12.1f} {:>10.1f} {:>12.1f}\n", config, conv,
                             ms_per_step("convolution"), reorder, ms_per_step("reorder"), other);
  }
  std::cout << train::dump_json(summary) << std::endl;
  return 0;
}

int run_one(const Flags& f) {
  apps::BenchOptions o;
  o.fused_routing = f.worker == "fused" || f.worker == "fused-bf16";
  if (f.worker == "fused-bf16") o.precision = parse_precision("bf16");
  o.model.routing_iterations = f.routing_iters;
  o.model.image_size = f.image_size;
  o.batch_size = f.batch_size;
  o.steps = f.steps;
  o.infer_batches = f.infer_batches;
  o.latency_runs = f.latency_runs;
  auto j = apps::run_benchmark(o).to_json();
  j["config"] = f.worker;
  j["impl"] = kDescriptions.at(f.worker);
  j["batch_size"] = f.batch_size;
  j["threads"] = at::get_num_threads();
  j["routing_iters"] = f.routing_iters;
  j["steps"] = f.steps;
  j["image_size"] = f.image_size;
  std::cout << train::dump_json(j) << std::endl;
  return 0;
}

const std::array<const char*, 6> kMetrics = {"train_img_s",       "infer_img_s",       "latency_b1_ms",
                                            "latency_b1_p90_ms", "train_peak_rss_mb", "train_rss_growth_mb"};

int run_all(const Flags& f) {
  std::unique_ptr<std::ofstream> jsonl;
  if (!f.jsonl.empty()) {
    jsonl = std::make_unique<std::ofstream>(f.jsonl, std::ios::app);
    if (!*jsonl) throw std::runtime_error("bench: cannot open " + f.jsonl + " for writing");
  }
  if (std::any_of(f.configs.begin(), f.configs.end(), is_peer) && access(f.python.c_str(), X_OK) != 0)
    throw std::runtime_error(fmt::format("bench: the peer needs Debian's python3 with python3-torch at {} "
                                         "(--python), or leave the peers out with --configs fused,reference",
                                         f.python));
  // The machine's practical peak in this run's conditions: the same threads, the same moment.
  const bool bf16 = cpu_has_native_bf16();
  const double peak_fp32 = apps::gemm_gflops(torch::kFloat);
  const double peak_bf16 = bf16 ? apps::gemm_gflops(torch::kBFloat16) : 0;
  std::cerr << fmt::format("bench: GEMM probe (2048^3, best of 5): fp32 {:.0f} GFLOP/s{}\n", peak_fp32,
                           bf16 ? fmt::format(", bf16 {:.0f} GFLOP/s", peak_bf16) : std::string());
  // Forward FLOPs of one image at a configuration's side (the peers build the same network at 28x28).
  auto flops_of = [&](const std::string& config) {
    models::CapsNetConfig model;
    model.routing_iterations = f.routing_iters;
    model.image_size = config_side(config);
    return apps::forward_flops_per_image(model);
  };

  std::map<std::string, std::map<std::string, std::vector<double>>> samples;  // config -> metric -> values
  const std::string& allocator = peer_allocator_env();
  if (std::any_of(f.configs.begin(), f.configs.end(), is_peer))
    std::cerr << "bench: the Python peers run on capsnet's allocator: "
              << (allocator.empty() ? std::string("glibc malloc (this build has no jemalloc)") : allocator) << "\n";
  std::cerr << fmt::format("bench: batch {}, {} timed steps, {} threads, {} repeat(s) of [{}]\n", f.batch_size,
                           f.steps, at::get_num_threads(), f.repeats, fmt::join(f.configs, ", "));
  for (int rep = 1; rep <= f.repeats; ++rep)
    for (const auto& config : f.configs) {
      std::cerr << fmt::format("bench: repeat {}/{} {:<15} ", rep, f.repeats, config) << std::flush;
      auto j = run_worker(worker_command(f, config));
      j["config"] = config;  // the name it was asked for, whatever the worker calls itself
      j["repeat"] = rep;
      for (const char* m : kMetrics) samples[config][m].push_back(j.at(m).get<double>());
      std::cerr << fmt::format(
          "train {:6.1f} img/s  infer {:6.1f} img/s  batch-1 {:6.2f} ms (p90 {:6.2f})  train peak RSS {:6.0f} MB\n",
          j.at("train_img_s").get<double>(), j.at("infer_img_s").get<double>(), j.at("latency_b1_ms").get<double>(),
          j.at("latency_b1_p90_ms").get<double>(), j.at("train_peak_rss_mb").get<double>());
      if (jsonl) *jsonl << train::dump_json(j) << '\n';
    }

  nlohmann::json summary = {{"summary", true},
                            {"repeats", f.repeats},
                            {"batch_size", f.batch_size},
                            {"threads", at::get_num_threads()},
                            {"peer_allocator", allocator.empty() ? std::string("glibc malloc") : allocator},
                            {"gemm_gflops", {{"fp32", peak_fp32}, {"bf16", peak_bf16}}},
                            {"forward_gflop_per_image", flops_of("fused") / 1e9}};
  std::cout << fmt::format("\nmedians of {} run(s), batch {}, {} threads:\n", f.repeats, f.batch_size,
                           at::get_num_threads());
  std::cout << fmt::format("{:<50} {:>11} {:>11} {:>11} {:>11} {:>13} {:>13}\n", "configuration", "train img/s",
                           "infer img/s", "batch-1 ms", "b-1 p90 ms", "train peak MB", "train grow MB");
  for (const auto& config : f.configs) {
    auto& s = samples[config];
    for (const char* m : kMetrics) summary["median"][config][m] = median(s[m]);
    std::cout << fmt::format("{:<50} {:>11.1f} {:>11.1f} {:>11.2f} {:>11.2f} {:>13.0f} {:>13.0f}\n",
                             describe_config(config), median(s["train_img_s"]), median(s["infer_img_s"]),
                             median(s["latency_b1_ms"]), median(s["latency_b1_p90_ms"]), median(s["train_peak_rss_mb"]),
                             median(s["train_rss_growth_mb"]));
  }
  // Achieved arithmetic rate: training = 3 forward passes' FLOPs per image (forward_flops_per_image).
  // Nominal FLOPs: the direct convolutions'. capsnet's PrimaryCaps runs through DFTs with 5.1x fewer
  // multiply-adds in both precisions (kernels/spectral_conv.h), so its shares of the probe can exceed 100%.
  std::cout << fmt::format("\nachieved GFLOP/s ({:.3f} GFLOP per 28x28 image forward, x3 for a training step; nominal: the "
                           "direct convolutions' count, which capsnet's PrimaryCaps (fp32 and bf16) undercuts 5x "
                           "in training and at batch >= 32 in inference) and share of the GEMM probe of the "
                           "configuration's compute type:\n",
                           flops_of("fused") / 1e9);
  std::cout << fmt::format("{:<50} {:>11} {:>8} {:>11} {:>8}\n", "configuration", "train", "% peak", "infer",
                           "% peak");
  for (const auto& config : f.configs) {
    const double peak = is_bf16_config(config) ? peak_bf16 : peak_fp32;
    const double config_flops = flops_of(config);
    const double train = 3 * config_flops * median(samples[config]["train_img_s"]) / 1e9;
    const double infer = config_flops * median(samples[config]["infer_img_s"]) / 1e9;
    summary["gflops"][config] = {
        {"train", train}, {"infer", infer}, {"peak", peak}, {"forward_gflop_per_image", config_flops / 1e9}};
    std::cout << fmt::format("{:<50} {:>11.1f} {:>7.1f}% {:>11.1f} {:>7.1f}%\n", describe_config(config), train,
                             100 * train / peak, infer, 100 * infer / peak);
  }
  auto ratios = [&](const std::string& a, const std::string& b) {
    if (!samples.count(a) || !samples.count(b)) return;
    auto m = [&](const std::string& c, const char* k) { return median(samples[c][k]); };
    nlohmann::json r = {{"train_speedup", m(a, "train_img_s") / m(b, "train_img_s")},
                        {"infer_speedup", m(a, "infer_img_s") / m(b, "infer_img_s")},
                        {"latency_b1_speedup", m(b, "latency_b1_ms") / m(a, "latency_b1_ms")},
                        {"train_peak_rss_ratio", m(a, "train_peak_rss_mb") / m(b, "train_peak_rss_mb")},
                        {"train_rss_growth_ratio", m(a, "train_rss_growth_mb") / m(b, "train_rss_growth_mb")}};
    summary["ratios"][a + "/" + b] = r;
    std::cout << fmt::format(
        "{} vs {}: training {:.2f}x, inference {:.2f}x, batch-1 latency {:.2f}x faster; training peak memory "
        "{:.2f} of it ({:.2f} of its growth)\n",
        a, b, r["train_speedup"].get<double>(), r["infer_speedup"].get<double>(),
        r["latency_b1_speedup"].get<double>(), r["train_peak_rss_ratio"].get<double>(),
        r["train_rss_growth_ratio"].get<double>());
  };
  std::cout << '\n';
  ratios("fused-bf16", "fused");
  ratios("fused-bf16", "peer-tuned-bf16");
  ratios("fused", "peer-tuned");
  ratios("fused-bf16", "peer-spectral-bf16");
  ratios("fused", "peer-spectral");
  ratios("fused-bf16", "peer");
  ratios("fused", "peer");
  ratios("peer-tuned", "peer");
  ratios("fused", "reference");
  ratios("reference", "peer");
  if (jsonl) *jsonl << train::dump_json(summary) << '\n';
  return 0;
}

}  // namespace

Subcommand add_bench(CLI::App& root) {
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "bench", "Training/inference speed, batch-1 latency and peak memory: fused op vs composite routing vs the "
               "plain-PyTorch peers (as published, tuned, spectral), side by side (synthetic data; each run in its "
               "own process)");
  app->add_option("--configs", f->configs,
                  "Which to run, comma-separated: fused, fused-bf16, reference, peer, peer-tuned, peer-tuned-bf16, "
                  "peer-spectral, peer-spectral-bf16; capsnet's configurations at another image side as NAME@SIDE, "
                  "e.g. fused-bf16@40 (the affine experiment's 40x40 model), fused-bf16@42 (the STN experiment's)")
      ->delimiter(',')
      ->check(CLI::Validator(check_config, "CONFIG[@SIDE]"))
      ->capture_default_str();
  app->add_option("--repeats", f->repeats, "Interleaved repeats; medians are reported")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--batch-size", f->batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_option("--steps", f->steps, "Timed training steps per run (after 2 warm-up steps)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--infer-batches", f->infer_batches, "Timed inference batches per run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--latency-runs", f->latency_runs, "Timed batch-1 forward passes per run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--routing-iters", f->routing_iters, "Routing iterations r")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--python", f->python, "Python with PyTorch for the peer")->capture_default_str();
  app->add_option("--peer-script", f->peer_script, "The naive peer's script")->capture_default_str();
  app->add_option("--tuned-peer-script", f->tuned_peer_script, "The tuned peer's script")->capture_default_str();
  app->add_option("--spectral-peer-script", f->spectral_peer_script, "The spectral peer's script")
      ->capture_default_str();
  app->add_option("--jsonl", f->jsonl, "Append every run and the summary as JSON lines to this file");
  app->add_flag("--onednn-counts", f->onednn_counts,
                "Instead of timing: count oneDNN primitive executions (convolutions, reorders) per training step "
                "of each capsnet configuration, from ONEDNN_VERBOSE=1");
  app->add_option("--worker", f->worker, "(internal) run one configuration and print one JSON line")
      ->check(CLI::IsMember({"fused", "fused-bf16", "reference"}))
      ->group("");
  app->add_option("--image-size", f->image_size, "(internal) the worker's image side")
      ->check(CLI::Range(int64_t{20}, int64_t{256}))
      ->group("");
  add_threads_flag(*app, f->threads);
  return {app, [f]() {
            if (f->threads > 0) set_threads(f->threads);
            if (!f->worker.empty()) return run_one(*f);
            // Appending to the Python or a peer script it runs would damage them.
            if (!f->jsonl.empty()) check_not_an_input(f->jsonl, {f->python, f->peer_script, f->tuned_peer_script, f->spectral_peer_script});
            return f->onednn_counts ? run_onednn_counts(*f) : run_all(*f);
          }};
}

}  // namespace capsnet::apps::cli
