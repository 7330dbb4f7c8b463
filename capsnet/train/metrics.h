#pragma once
// Metrics as JSON lines (one object per line, flushed) and a terminal progress bar.

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

namespace capsnet::train {

/// Appends one JSON object per line to a file and flushes each line (a crash loses nothing written).
class JsonLinesWriter {
 public:
  JsonLinesWriter() = default;
  /// Opens `path` for appending (truncate = false) or anew; throws std::runtime_error if it cannot.
  explicit JsonLinesWriter(const std::string& path, bool truncate = false);
  void write(const nlohmann::json& record);
  bool is_open() const { return out_.is_open(); }

 private:
  std::ofstream out_;
};

/// A one-line progress bar: redrawn in place on a terminal, a plain line every ~10% otherwise.
class ProgressBar {
 public:
  ProgressBar(std::ostream& out, std::string label, int64_t total, bool enabled = true);
  /// Sets the position and the text shown after the bar (e.g. "loss 0.12 acc 97.1% 160 img/s").
  void update(int64_t done, const std::string& suffix);
  /// Ends the line.
  void finish(const std::string& suffix);

 private:
  std::ostream& out_;
  std::string label_;
  int64_t total_;
  bool enabled_, tty_;
  int64_t last_decile_ = -1;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

/// "1:02:03" / "2:03" for a duration in seconds.
std::string format_duration(double seconds);

}  // namespace capsnet::train
