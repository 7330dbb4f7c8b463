#include "apps/precision_probe.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <vector>

#include "capsnet/models/capsnet.h"
#include "capsnet/train/checkpoint.h"

namespace capsnet::apps {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// One training step of `model` (forward, loss, backward; gradients dropped after), in ms.
double time_step(models::CapsNet& model, const torch::Tensor& images, const torch::Tensor& labels) {
  const auto start = std::chrono::steady_clock::now();
  auto out = model(images, labels);
  model->loss(out, images, labels).total.backward();
  const auto end = std::chrono::steady_clock::now();
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  return std::chrono::duration<double, std::milli>(end - start).count();
}

// The median time in ms of `steps` training steps of `model` at `precision` (after the warm-up step, which the
// caller has run at this precision).
double median_step_ms(models::CapsNet& model, const torch::Tensor& images, const torch::Tensor& labels, int steps) {
  std::vector<double> ms;
  for (int s = 0; s < steps; ++s) ms.push_back(time_step(model, images, labels));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::string entry_key(const std::string& cpu, int threads) { return fmt::format("{} | {} threads", cpu, threads); }

// The cache's entry under `key` (choice and both times), or nullopt when it is missing or malformed.
std::optional<PrecisionProbe> cached_probe(const nlohmann::json& cache, const std::string& key) {
  if (!cache.is_object() || !cache.contains(key)) return std::nullopt;
  try {
    const auto& e = cache.at(key);
    const auto choice = e.at("choice").get<std::string>();
    if (choice != "bf16" && choice != "fp32") return std::nullopt;
    PrecisionProbe p;
    p.fp32_ms = e.at("fp32_ms").get<double>();
    p.bf16_ms = e.at("bf16_ms").get<double>();
    p.choice = parse_precision(choice);
    p.cached = true;
    return p;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

}  // namespace

std::string cpu_model_name() {
  // The model name alone can be the same for two core generations (e.g. "AMD EPYC" on Zen 4 and Zen 5):
  // the family and model numbers tell them apart.
  std::ifstream in("/proc/cpuinfo");
  std::string name, family, model;
  auto value = [](const std::string& line) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) return std::string();
    auto v = line.substr(colon + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    return v;
  };
  for (std::string line; std::getline(in, line) && !line.empty();) {  // the first processor's block
    if (line.rfind("model name", 0) == 0) name = value(line);
    else if (line.rfind("cpu family", 0) == 0) family = value(line);
    else if (line.rfind("model", 0) == 0 && line.find_first_not_of(" \t", 5) != std::string::npos &&
             line[line.find_first_not_of(" \t", 5)] == ':')
      model = value(line);
  }
  if (name.empty()) name = "unknown CPU";
  if (!family.empty() && !model.empty()) name += fmt::format(" (family {}, model {})", family, model);
  return name;
}

PrecisionProbe measure_precision(int64_t batch, int steps, double max_warmup_ms) {
  if (!cpu_has_native_bf16())
    throw std::invalid_argument("measure_precision: this CPU has no native bf16 arithmetic (AVX512_BF16 or AMX)");
  if (batch <= 0 || steps <= 0)
    throw std::invalid_argument(fmt::format("measure_precision: batch and steps must be positive, got {} and {}",
                                            batch, steps));
  if (!(max_warmup_ms >= 0))
    throw std::invalid_argument(fmt::format("measure_precision: max_warmup_ms must be >= 0, got {}", max_warmup_ms));
  PrecisionProbe p;
  p.cpu = cpu_model_name();
  p.threads = at::get_num_threads();
  // The paper's model on seeded inputs; its own generator, so the caller's random stream is untouched.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12345);
  models::CapsNet model(models::CapsNetConfig{});
  model->train();
  auto images = torch::rand({batch, 1, 28, 28}, gen);                 // [B, 1, 28, 28]
  auto labels = torch::randint(0, 10, {batch}, gen, torch::kLong);    // [B]
  model->set_precision(Precision::kFloat32);
  const double warmup_ms = time_step(model, images, labels);
  if (warmup_ms > max_warmup_ms) {  // a busy machine: its timings would say nothing about the precisions
    p.busy = true;
    p.fp32_ms = warmup_ms;
    p.choice = Precision::kBFloat16;  // the instruction rule
    return p;
  }
  p.fp32_ms = median_step_ms(model, images, labels, steps);
  model->set_precision(Precision::kBFloat16);
  time_step(model, images, labels);  // warm-up
  p.bf16_ms = median_step_ms(model, images, labels, steps);
  p.choice = p.bf16_ms < p.fp32_ms ? Precision::kBFloat16 : Precision::kFloat32;
  return p;
}

double probe_budget_ms() {
  const auto text = env("CAPSNET_PROBE_MAX_MS");
  if (text.empty()) return 3000;
  double ms = -1;
  size_t used = 0;
  try {
    ms = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !(ms >= 0) || !std::isfinite(ms))
    throw std::invalid_argument(
        fmt::format("CAPSNET_PROBE_MAX_MS must be a non-negative number of milliseconds, got '{}'", text));
  return ms;
}

std::string precision_cache_path() {
  std::string dir = env("CAPSNET_CACHE_DIR");
  if (dir.empty() && !env("XDG_CACHE_HOME").empty()) dir = env("XDG_CACHE_HOME") + "/capsnet";
  if (dir.empty() && !env("HOME").empty()) dir = env("HOME") + "/.cache/capsnet";
  if (dir.empty()) dir = std::filesystem::temp_directory_path().string() + "/capsnet";
  return dir + "/precision-probe.json";
}

Precision resolve_auto_precision(std::ostream& log) {
  if (!cpu_has_native_bf16()) {
    log << "note: --precision auto: this CPU has no native bf16 arithmetic (AVX512_BF16 or AMX), computing in fp32\n";
    return Precision::kFloat32;
  }
  if (env("CAPSNET_PRECISION_AUTO") == "cpuid") return Precision::kBFloat16;
  const auto path = precision_cache_path();
  const auto cpu = cpu_model_name();
  const int threads = at::get_num_threads();
  const auto key = entry_key(cpu, threads);
  nlohmann::json cache = nlohmann::json::object();
  {
    std::ifstream in(path);
    if (in) {
      try {
        cache = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception&) {
        cache = nlohmann::json::object();  // damaged: measured again and rewritten
      }
    }
  }
  PrecisionProbe p;
  std::string where = "cached in";
  if (auto cached = cached_probe(cache, key)) {
    p = *cached;
    p.cpu = cpu;
    p.threads = threads;
  } else {
    const double budget = probe_budget_ms();
    p = measure_precision(32, 3, budget);
    if (p.busy) {
      log << fmt::format(
          "note: --precision auto: bf16 (the machine is busy: one fp32 probe step took {:.0f} ms, over the {:.0f} ms "
          "budget, so nothing was measured or cached in {}; bf16 because this CPU has native bf16; "
          "--precision fp32|bf16 chooses explicitly)\n",
          p.fp32_ms, budget, path);
      return p.choice;
    }
    if (!cache.is_object()) cache = nlohmann::json::object();
    cache[key] = {{"choice", precision_name(p.choice)}, {"fp32_ms", p.fp32_ms}, {"bf16_ms", p.bf16_ms},
                  {"probe", "one training step of the paper's MNIST CapsNet, batch 32, median of 3"}};
    try {
      const auto text = cache.dump(2) + "\n";
      train::write_file_atomically(path, std::vector<char>(text.begin(), text.end()));
      where = "measured now, cached in";
    } catch (const std::exception& e) {
      log << fmt::format("note: --precision auto: could not cache the probe in {}: {}\n", path, e.what());
      where = "measured now, not cached in";
    }
  }
  log << fmt::format("note: --precision auto: {} (a training step: bf16 {:.0f} ms, fp32 {:.0f} ms on {}, {} threads; "
                     "{} {})\n",
                     precision_name(p.choice), p.bf16_ms, p.fp32_ms, cpu, threads, where, path);
  return p.choice;
}

}  // namespace capsnet::apps
