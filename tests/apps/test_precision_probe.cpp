// --precision auto, measured (apps/precision_probe.h): the cache's place, a probe that times both precisions
// and caches its choice per CPU and thread count, a cached entry obeyed (by the library call and by
// `capsnet train`), a damaged cache measured again, CAPSNET_PRECISION_AUTO=cpuid as the rule, and fp32
// without native bf16.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "apps/precision_probe.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

// Sets an environment variable for the scope of the object (unset with nullopt), restoring it afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value->c_str(), 1);
    else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string key_here() { return apps::cpu_model_name() + " | " + std::to_string(at::get_num_threads()) + " threads"; }

TEST(PrecisionProbe, CachePathFollowsCapsnetCacheDirThenXdgThenHome) {
  ScopedEnv a("CAPSNET_CACHE_DIR", "/tmp/a"), x("XDG_CACHE_HOME", "/tmp/x"), h("HOME", "/tmp/h");
  EXPECT_EQ(apps::precision_cache_path(), "/tmp/a/precision-probe.json");
  {
    ScopedEnv none("CAPSNET_CACHE_DIR", std::nullopt);
    EXPECT_EQ(apps::precision_cache_path(), "/tmp/x/capsnet/precision-probe.json");
    ScopedEnv no_xdg("XDG_CACHE_HOME", std::nullopt);
    EXPECT_EQ(apps::precision_cache_path(), "/tmp/h/.cache/capsnet/precision-probe.json");
  }
  EXPECT_FALSE(apps::cpu_model_name().empty());
}

TEST(PrecisionProbe, WithoutNativeBf16AutoIsFp32WithANoteAndNoProbe) {
  if (cpu_has_native_bf16()) GTEST_SKIP() << "this CPU has native bf16";
  testing::TempDir dir;
  ScopedEnv c("CAPSNET_CACHE_DIR", dir.str()), rule("CAPSNET_PRECISION_AUTO", std::nullopt);
  std::ostringstream log;
  EXPECT_EQ(apps::resolve_auto_precision(log), Precision::kFloat32);
  EXPECT_NE(log.str().find("no native bf16"), std::string::npos) << log.str();
  EXPECT_FALSE(std::filesystem::exists(dir / "precision-probe.json"));
  EXPECT_THROW(apps::measure_precision(), std::invalid_argument);
}

TEST(PrecisionProbe, MeasuresOnceCachesPerCpuAndThreadsAndObeysTheCache) {
  if (!cpu_has_native_bf16()) GTEST_SKIP() << "no native bf16: auto is fp32 without a probe";
  testing::TempDir dir;
  // No busy-machine fallback here (the test suite may share the cores): this test is about measuring.
  ScopedEnv c("CAPSNET_CACHE_DIR", dir / "cache"), rule("CAPSNET_PRECISION_AUTO", std::nullopt),
      budget("CAPSNET_PROBE_MAX_MS", "1e9");
  const std::string path = dir / "cache/precision-probe.json";

  // The rule skips the probe and the cache.
  {
    ScopedEnv cpuid("CAPSNET_PRECISION_AUTO", "cpuid");
    std::ostringstream log;
    EXPECT_EQ(apps::resolve_auto_precision(log), Precision::kBFloat16);
    EXPECT_FALSE(std::filesystem::exists(path));
  }

  // First call: measured, and the faster precision is chosen and cached under this CPU and thread count.
  std::ostringstream log;
  const auto chosen = apps::resolve_auto_precision(log);
  EXPECT_NE(log.str().find("measured now"), std::string::npos) << log.str();
  auto cache = nlohmann::json::parse(std::ifstream(path));
  ASSERT_TRUE(cache.contains(key_here())) << cache.dump();
  const auto& entry = cache[key_here()];
  EXPECT_GT(entry["fp32_ms"].get<double>(), 0);
  EXPECT_GT(entry["bf16_ms"].get<double>(), 0);
  EXPECT_EQ(entry["choice"], entry["bf16_ms"].get<double>() < entry["fp32_ms"].get<double>() ? "bf16" : "fp32");
  EXPECT_EQ(precision_name(chosen), entry["choice"]);

  // An entry saying fp32 is faster is obeyed without measuring; another CPU's entry stays untouched.
  cache[key_here()] = {{"choice", "fp32"}, {"fp32_ms", 10.0}, {"bf16_ms", 20.0}};
  cache["Some Other CPU | 64 threads"] = {{"choice", "bf16"}, {"fp32_ms", 20.0}, {"bf16_ms", 10.0}};
  std::ofstream(path) << cache.dump();
  std::ostringstream cached_log;
  EXPECT_EQ(apps::resolve_auto_precision(cached_log), Precision::kFloat32);
  EXPECT_NE(cached_log.str().find("fp32 (a training step: bf16 20 ms, fp32 10 ms"), std::string::npos)
      << cached_log.str();
  EXPECT_NE(cached_log.str().find("cached in"), std::string::npos);

  // `capsnet train --precision auto` (its default) follows the same cache: the start event says fp32.
  testing::write_fake_mnist(dir / "mnist", 8, 4);
  const std::string run = dir / "run";
  auto r = testing::run_command("CAPSNET_PRECISION_AUTO= CAPSNET_CACHE_DIR=" + (dir / "cache") + " " + CAPSNET_CLI +
                                " train --data " + (dir / "mnist") + " --out " + run +
                                " --steps 1 --batch-size 4 --no-progress --threads " +
                                std::to_string(at::get_num_threads()));
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream metrics(run + "/metrics.jsonl");
  std::string first;
  ASSERT_TRUE(std::getline(metrics, first));
  EXPECT_EQ(nlohmann::json::parse(first)["train"]["precision"], "fp32") << first;
  EXPECT_NE(r.output.find("--precision auto: fp32"), std::string::npos) << r.output;

  // A damaged cache is measured again and rewritten, keeping nothing of the damage.
  std::ofstream(path) << "{not json";
  std::ostringstream again;
  apps::resolve_auto_precision(again);
  EXPECT_NE(again.str().find("measured now"), std::string::npos) << again.str();
  EXPECT_TRUE(nlohmann::json::parse(std::ifstream(path)).contains(key_here()));
}

TEST(PrecisionProbe, ABusyMachineFallsBackToTheInstructionRuleAndCachesNothing) {
  if (!cpu_has_native_bf16()) GTEST_SKIP() << "no native bf16: auto is fp32 without a probe";
  // The fp32 warm-up step over the budget: the probe stops there and says so.
  const auto busy = apps::measure_precision(4, 1, /*max_warmup_ms=*/0.0);
  EXPECT_TRUE(busy.busy);
  EXPECT_GT(busy.fp32_ms, 0);
  EXPECT_EQ(busy.bf16_ms, 0);
  EXPECT_EQ(busy.choice, Precision::kBFloat16);
  // Within the budget both precisions are timed.
  const auto idle = apps::measure_precision(4, 1, /*max_warmup_ms=*/1e9);
  EXPECT_FALSE(idle.busy);
  EXPECT_GT(idle.fp32_ms, 0);
  EXPECT_GT(idle.bf16_ms, 0);
  EXPECT_THROW(apps::measure_precision(4, 1, -1.0), std::invalid_argument);

  // resolve_auto_precision with CAPSNET_PROBE_MAX_MS=0: bf16, a note saying why, and no cache file.
  testing::TempDir dir;
  ScopedEnv c("CAPSNET_CACHE_DIR", dir / "cache"), rule("CAPSNET_PRECISION_AUTO", std::nullopt),
      budget("CAPSNET_PROBE_MAX_MS", "0");
  const std::string path = dir / "cache/precision-probe.json";
  std::ostringstream log;
  EXPECT_EQ(apps::resolve_auto_precision(log), Precision::kBFloat16);
  EXPECT_NE(log.str().find("the machine is busy"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("over the 0 ms budget"), std::string::npos) << log.str();
  EXPECT_FALSE(std::filesystem::exists(path));

  // A cached entry is still obeyed (the budget only concerns a new probe).
  std::filesystem::create_directories(dir / "cache");
  std::ofstream(path)
      << nlohmann::json{{key_here(), {{"choice", "fp32"}, {"fp32_ms", 10.0}, {"bf16_ms", 20.0}}}}.dump();
  std::ostringstream cached;
  EXPECT_EQ(apps::resolve_auto_precision(cached), Precision::kFloat32);

  // A malformed budget is refused, naming the variable.
  std::filesystem::remove(path);
  for (const char* bad : {"abc", "-1", "5ms", "nan"}) {
    ScopedEnv b("CAPSNET_PROBE_MAX_MS", bad);
    std::ostringstream ignored;
    try {
      apps::resolve_auto_precision(ignored);
      ADD_FAILURE() << "accepted CAPSNET_PROBE_MAX_MS=" << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("CAPSNET_PROBE_MAX_MS"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(apps::probe_budget_ms(), 0.0);  // the scope's "0" again
}

}  // namespace
}  // namespace capsnet
