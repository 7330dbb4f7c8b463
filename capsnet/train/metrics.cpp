#include "capsnet/train/metrics.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include "capsnet/train/json_input.h"

namespace capsnet::train {

JsonLinesWriter::JsonLinesWriter(const std::string& path, bool truncate) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  out_.open(path, truncate ? std::ios::trunc : std::ios::app);
  if (!out_) throw std::runtime_error("cannot open metrics file " + path + " for writing");
}

void JsonLinesWriter::write(const nlohmann::json& record) {
  if (!out_.is_open()) return;
  if (record.is_object() && !record.contains("time")) {
    // Wall-clock stamp (Unix seconds) on every record: time-to-accuracy is read off the log.
    auto stamped = record;
    stamped["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    out_ << dump_json(stamped) << '\n';
  } else {
    out_ << dump_json(record) << '\n';
  }
  out_.flush();
  // A full disk must not lose metrics silently.
  if (!out_) throw std::runtime_error("writing a metrics record failed (disk full or I/O error)");
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

ProgressBar::ProgressBar(std::ostream& out, std::string label, int64_t total, bool enabled)
    : out_(out), label_(std::move(label)), total_(std::max<int64_t>(total, 1)), enabled_(enabled),
      tty_(&out == &std::cerr ? isatty(STDERR_FILENO) : (&out == &std::cout ? isatty(STDOUT_FILENO) : false)),
      start_(std::chrono::steady_clock::now()), last_draw_(start_) {}

void ProgressBar::update(int64_t done, const std::string& suffix) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = done > 0 ? elapsed * static_cast<double>(total_ - done) / static_cast<double>(done) : NAN;
  if (tty_) {
    if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    constexpr int kWidth = 28;
    const int filled = static_cast<int>(kWidth * done / total_);
    out_ << fmt::format("\r\033[K{} [{}{}] {}/{} {} ETA {}", label_, std::string(filled, '='),
                        std::string(kWidth - filled, ' '), done, total_, suffix, format_duration(eta))
         << std::flush;
  } else {
    const int64_t decile = 10 * done / total_;
    if (decile == last_decile_ || done == total_) return;  // finish() prints the last line
    last_decile_ = decile;
    out_ << fmt::format("{} {}/{} {} ETA {}\n", label_, done, total_, suffix, format_duration(eta)) << std::flush;
  }
}

void ProgressBar::finish(const std::string& suffix) {
  if (!enabled_) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  out_ << (tty_ ? "\r\033[K" : "") << fmt::format("{} {}/{} {} in {}\n", label_, total_, total_, suffix,
                                                  format_duration(elapsed))
       << std::flush;
}

}  // namespace capsnet::train
