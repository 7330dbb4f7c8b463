// Every numeric flag of every command has a documented range, checked on the text before it is
// converted (so -1 never wraps to 2^64-1 and 2^63 never overflows into a negative step count).
// docs/reliability.md prints this table; a numeric flag missing from it stops the tool at start-up.
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>
#include <stdexcept>

#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace {

struct Range {
  double lo, hi;
  bool integer;
};

constexpr double kI63 = 9223372036854775807.0;  // 2^63 - 1: seeds are stored as signed 64-bit

const std::map<std::string, Range>& limits() {
  static const std::map<std::string, Range> table = {
      {"--batch-size", {1, 65536, true}},      {"--eval-batch-size", {1, 65536, true}},
      {"--steps", {0, 1e9, true}},             {"--epochs", {0, 1e5, true}},
      {"--log-every", {1, 1e9, true}},         {"--checkpoint-every", {0, 1e9, true}},
      {"--seed", {0, kI63, true}},             {"--test-seed", {0, kI63, true}},
      {"--probe-seed", {0, kI63, true}},       {"--lr", {1e-12, 10, false}},
      {"--lr-decay", {1e-9, 1, false}},        {"--weight-decay", {0, 1, false}},
      {"--routing-iters", {1, 100, true}},     {"--train-limit", {0, 1e9, true}},
      {"--test-limit", {0, 1e9, true}},        {"--limit", {0, 1e9, true}},
      {"--test-size", {0, 1e7, true}},         {"--train-size", {0, 1e9, true}},
      {"--threads", {0, 256, true}},           {"--nproc", {1, 64, true}},
      {"--primary-types", {1, 4096, true}},    {"--types", {1, 4096, true}},
      {"--caps1-types", {1, 4096, true}},      {"--caps2-types", {1, 4096, true}},
      {"--conv1-channels", {1, 4096, true}},   {"--stem-channels", {1, 4096, true}},
      {"--max-shift", {0, 27, true}},          {"--max-offset", {0, 1024, false}},
      {"--zoom", {1, 64, true}},               {"--wrong", {0, 10000, true}},
      {"--correct", {0, 10000, true}},         {"--figure-wrong", {0, 10000, true}},
      {"--figure-correct", {0, 10000, true}},  {"--figure-rows", {0, 10000, true}},
      {"--figure-examples", {0, 10000, true}}, {"--threshold", {0, 1, false}},
      {"--stn-size", {0, 1024, true}},
      {"--probe", {0, 100000, true}},          {"--port", {0, 65535, true}},
      {"--noise", {0, 1, false}},              {"--max-minutes", {0, 1e6, false}},
      {"--max-body", {1, 1 << 30, true}},      {"--margin-start", {0, 1, false}},
      {"--margin-end", {0, 1, false}},         {"--latency-runs", {1, 1e6, true}},
      {"--lambda-first", {0, 1e6, false}},     {"--lambda-last", {0, 1e6, false}},
      {"--lambda-base", {0, 1e6, false}},     {"--variance-eps", {0, 1e3, false}},
      {"--infer-batches", {1, 1e6, true}},     {"--index", {0, 1e9, true}},
      {"--fragments", {0, 100, true}},         {"--canvas", {8, 1024, true}},
      {"--repeats", {1, 1000, true}},          {"--routing", {1, 100, true}},          {"--dist-timeout", {0.001, 86400, false}},
      {"--image-size", {0, 1024, true}},       {"--test-fraction", {0, 0.99, false}},
      {"--split-seed", {0, kI63, true}},       {"--side", {1, 1024, true}},
      {"--warmup-fraction", {0, 0.99, false}}, {"--request-timeout", {0.001, 86400, false}},
      {"--recon-weight", {0, 1e6, false}},     {"--target-accuracy", {0, 1, false}},
      {"--eval-every", {0, 1e9, true}},       {"--lr-decay-steps", {0, 1e9, true}},
      {"--val", {0, 1e9, true}},              {"--mode-seeking", {0, 1e6, false}},
      {"--ema-decay", {0, 0.999999, false}},
      {"--cnn-channels", {1, 4096, true}},     {"--patience", {0, 1e9, true}},
  };
  return table;
}

std::string check_text(const std::string& text, const Range& r) {
  const auto out_of_range = [&] {
    return fmt::format("{} is out of range [{:g}, {:g}]", text, r.lo, r.hi);
  };
  if (r.integer) {
    int64_t v = 0;
    const char* end = text.data() + text.size();
    auto [p, ec] = std::from_chars(text.data(), end, v);
    if (ec == std::errc::result_out_of_range) return out_of_range();
    if (ec != std::errc() || p != end) return fmt::format("{} is not an integer", text);
    if (static_cast<double>(v) < r.lo || static_cast<double>(v) > r.hi) return out_of_range();
    return {};
  }
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) return fmt::format("{} is not a number", text);
  if (!std::isfinite(v) || v < r.lo || v > r.hi) return out_of_range();
  return {};
}

bool is_numeric(const CLI::Option* o) {
  const auto t = o->get_type_name();
  return o->get_expected_min() > 0 && (t.rfind("INT", 0) == 0 || t.rfind("UINT", 0) == 0 || t.rfind("FLOAT", 0) == 0);
}

}  // namespace

void apply_numeric_limits(CLI::App& app) {
  for (auto* sub : app.get_subcommands({})) {
    for (auto* o : sub->get_options()) {
      if (o->get_lnames().empty()) continue;  // positional arguments: checked by their command
      const auto name = "--" + o->get_lnames().front();  // "--batch-size"
      auto it = limits().find(name);
      if (it == limits().end()) {
        if (is_numeric(o))
          throw std::logic_error(fmt::format("capsnet {} {}: numeric option without a documented range (cli/limits.cpp)",
                                             sub->get_name(), name));
        continue;
      }
      const Range r = it->second;
      if (r.integer && o->get_type_name().rfind("FLOAT", 0) == 0)
        throw std::logic_error(fmt::format("capsnet {} {}: a real-valued option with an integer range (cli/limits.cpp)",
                                           sub->get_name(), name));
      // First of the option's validators (transform() prepends; it changes nothing): the documented
      // range speaks before a command's own CLI::Range / NonNegativeNumber, whose messages print 1.8e308.
      o->transform(CLI::Validator([r](std::string& text) { return check_text(text, r); },
                                  fmt::format("{:g}..{:g}", r.lo, r.hi), "RANGE"));
    }
    apply_numeric_limits(*sub);
  }
}

std::string numeric_limits_markdown() {
  std::string md = "| flag | range | kind |\n|---|---|---|\n";
  for (const auto& [name, r] : limits())
    md += fmt::format("| `{}` | [{:g}, {:g}] | {} |\n", name, r.lo, r.hi, r.integer ? "integer" : "real");
  return md;
}

}  // namespace capsnet::apps::cli
