#pragma once
// --precision auto, measured: bf16 only where it is measured faster than fp32 on the machine at hand.
//
// Native bf16 instructions (AVX512_BF16, AMX) are necessary, not sufficient: how much a bf16 training step
// gains depends on the core (Zen 4 runs bf16 dot products at half the rate of Zen 5) and on the thread count.
// So `auto` times one training step of the paper's MNIST CapsNet (batch 32, forward and backward, the median
// of 3 after a warm-up) in each precision, picks the faster, and caches the result per CPU model and thread
// count in a small JSON file, so the probe runs once per machine (about a second).
//
// A busy machine would make the probe slow and its numbers meaningless (other processes, not the precision,
// decide them): when the fp32 warm-up step alone takes longer than a budget (3 s, about 10x an idle 2-core
// machine's), the probe stops there, `auto` falls back to the instruction rule (bf16) for this run, and
// nothing is cached, so an idle run measures later. CAPSNET_PROBE_MAX_MS sets that budget in milliseconds.
//
// Environment: CAPSNET_PRECISION_AUTO=cpuid skips the probe (bf16 wherever the instructions exist, the rule
// before the probe; the test suite sets it so that its runs do not depend on timing); CAPSNET_CACHE_DIR
// (else $XDG_CACHE_HOME/capsnet, else $HOME/.cache/capsnet) holds precision-probe.json.

#include <ostream>
#include <string>

#include "capsnet/kernels/precision.h"

namespace capsnet::apps {

struct PrecisionProbe {
  std::string cpu;  // cpu_model_name()
  int threads = 0;  // torch intra-op threads during the probe
  double fp32_ms = 0, bf16_ms = 0;  // median time of one training step
  Precision choice = Precision::kFloat32;
  bool cached = false;  // read from the cache file rather than measured now
  bool busy = false;    // the fp32 warm-up step exceeded the budget: not measured (fp32_ms = that step, bf16_ms = 0)
};

/// The CPU's model name with its family and model numbers, e.g. "AMD EPYC (family 26, model 2)".
std::string cpu_model_name();

/// Times a training step of the paper's CapsNet at batch `batch` in fp32 and in bf16 (`steps` timed steps
/// after one warm-up each; the median) at the current thread count. When the fp32 warm-up step takes more than
/// `max_warmup_ms`, stops there and returns `busy` with the instruction rule's choice (bf16). Needs native bf16
/// (std::invalid_argument otherwise, also for a negative budget).
PrecisionProbe measure_precision(int64_t batch = 32, int steps = 3, double max_warmup_ms = 3000);

/// The probe's warm-up budget: $CAPSNET_PROBE_MAX_MS (a non-negative number of milliseconds), else 3000.
/// std::invalid_argument naming the variable when it is set to anything else.
double probe_budget_ms();

/// $CAPSNET_CACHE_DIR, else $XDG_CACHE_HOME/capsnet, else $HOME/.cache/capsnet, plus "/precision-probe.json".
std::string precision_cache_path();

/// What --precision auto means here: fp32 without native bf16 (no probe); with CAPSNET_PRECISION_AUTO=cpuid,
/// bf16; else the cached probe for this CPU and thread count, or a new probe written to the cache (a cache
/// that cannot be written only costs the probe next time; a busy probe is not cached). `log` gets one line
/// saying which and why.
Precision resolve_auto_precision(std::ostream& log);

}  // namespace capsnet::apps
