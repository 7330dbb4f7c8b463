#pragma once
// `capsnet report`: one self-contained HTML page gathering what the experiments wrote under a runs
// directory: training curves (metrics.jsonl), figures (*.png, embedded), and result tables (*.json and
// bench *.jsonl summaries), with a results row per run for the experiment kinds it recognises.

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace capsnet::apps {

/// One curve: (x, y) points in drawing order.
struct Series {
  std::string label;
  std::vector<double> x, y;
};

/// An SVG line chart (inline, no scripts): axes with min/max ticks, one polyline per series, a legend.
/// Series with no points are skipped; throws std::invalid_argument if x and y differ in length.
std::string svg_line_chart(const std::vector<Series>& series, const std::string& x_label,
                           const std::string& y_label, int width = 560, int height = 260);

/// Escapes & < > " ' for HTML text and attribute values.
std::string html_escape(const std::string& text);

/// Standard base64 (RFC 4648, with padding), for embedding PNGs as data: URIs.
std::string base64_encode(const std::string& bytes);

/// JSON -> HTML table: an array of objects becomes one row per object (columns = `leading_columns` that
/// occur, then the union of keys in first-seen order); an object becomes key/value rows. Nested objects
/// become nested tables, lists of scalars a wrapped list; all text is escaped.
std::string json_table(const nlohmann::json& value, const std::vector<std::string>& leading_columns = {});

struct ReportSummary {
  int runs_with_metrics = 0, figures = 0, tables = 0;
};

/// Scans `runs_dir` recursively and writes the page to `out_path` (parent directories created).
/// Curves come from metrics.jsonl (and NAME.metrics.jsonl) files, figures from *.png, tables from *.json
/// and bench *.jsonl. Runs of a recognised experiment kind (the "task" of their summary JSON and of their
/// metrics' start record; today capspix2pix) get that kind's curves (e.g. generator L1, discriminator
/// loss), a results table with one row per run ahead of the full summaries, and the figures beside a
/// summary named TASK.json grouped under the run with the summary's captions; any other run gets the
/// classifier's curves (loss, accuracy) and the generic tables. Files are visited in sorted path order
/// so the page is reproducible. Throws std::runtime_error if `runs_dir` is not a directory or the page
/// cannot be written.
ReportSummary write_report(const std::string& runs_dir, const std::string& out_path,
                           const std::string& title = "capsnet report");

}  // namespace capsnet::apps
