#include "apps/report.h"
#include "capsnet/train/json_input.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>

namespace capsnet::apps {
namespace {

namespace fs = std::filesystem;

const char* const kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("report: cannot read " + p.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string number(double v) {
  if (!std::isfinite(v)) return "–";
  if (v != 0 && (std::fabs(v) < 1e-3 || std::fabs(v) >= 1e6)) return fmt::format("{:.3e}", v);
  if (std::fabs(v - std::round(v)) < 1e-12) return fmt::format("{:.0f}", v);
  return fmt::format("{:.4g}", v);
}

// Arrays and objects nested deeper than this are shown as "…": rendering recurses once per level, and
// a crafted file may nest 100,000 levels (the parser itself is iterative), which would overflow the stack.
constexpr int kMaxTableDepth = 32;

// Files the report reads are untrusted: values nested deeper than train::kMaxJsonDepth are refused when
// parsed, as malformed (copying and destroying a value recurse once per level).
nlohmann::json parse_untrusted(const std::string& text) { return train::parse_json_or_discarded(text); }

std::string json_table_at(const nlohmann::json& value, const std::vector<std::string>& leading_columns, int depth);

std::string cell(const nlohmann::json& v, int depth) {
  if (v.is_number()) return number(v.get<double>());
  if (v.is_string()) return html_escape(v.get<std::string>());
  if (v.is_boolean()) return v.get<bool>() ? "yes" : "no";
  if (v.is_null()) return "";
  if (depth >= kMaxTableDepth) return "…";
  const bool scalars = std::none_of(v.begin(), v.end(), [](const auto& e) { return e.is_structured(); });
  if (v.is_array() && scalars) {  // e.g. a per-dimension list: short numbers, wrapped
    std::string out;
    for (const auto& e : v) out += (out.empty() ? "" : ", ") + cell(e, depth + 1);
    return "<span class=list>[" + out + "]</span>";
  }
  return json_table_at(v, {}, depth + 1);  // nested objects / arrays of objects: a table inside the cell
}

// What the page knows of an experiment kind beyond the generic tables, matched by the "task" of its summary
// JSON and of its metrics' start record: the charts of its curves, one results row per run (columns read
// from the summary), and the figures its run writes beside the summary. A run of no listed kind gets the
// classifier's charts and the generic tables. To recognise another kind, add an entry to kinds().
struct Curve {
  const char* label;
  const char* event;  // records of metrics.jsonl it reads: "train" or "eval"
  const char* key;
  bool percent = false;  // its last value (eval curves) is printed as a percentage
};
struct Chart {
  const char* y_label;
  std::vector<Curve> curves;
};
struct Column {
  enum Format { kNumber, kPercent, kCount };  // kCount: an integer with thousands separators (1,023,873)
  const char* header;
  const char* pointer;  // JSON pointer into the summary; an absent value leaves the cell empty
  Format format = kNumber;
};
struct Kind {
  std::string task;  // "" = any run of no listed kind
  std::string title;
  std::vector<Chart> charts;
  std::vector<Column> columns;
  std::vector<std::string> figures;  // PNG names, in reading order; captions from the summary's "figures"
};

const std::vector<Kind>& kinds() {
  static const std::vector<Kind> all{
      {"",
       "",
       {{"loss", {{"train loss", "train", "loss"}}},
        {"accuracy", {{"train accuracy", "train", "accuracy"}, {"test accuracy", "eval", "accuracy", true}}}},
       {},
       {}},
      {"capspix2pix",
       "CapsPix2pix and pix2pix (capsnet capspix2pix, docs/capspix2pix.md)",
       {{"generator L1", {{"train L1", "train", "l1"}, {"test L1", "eval", "l1"}}},
        {"GAN loss (BCE)", {{"discriminator", "train", "d_loss"}, {"generator GAN term", "train", "g_gan"}}}},
       {{"generator", "/generator"},
        {"G parameters", "/generator_parameters", Column::kCount},
        {"D parameters", "/discriminator_parameters", Column::kCount},
        {"steps", "/steps", Column::kCount},
        {"batch", "/batch_size"},
        {"images", "/images_seen", Column::kCount},
        {"test maps", "/test/maps"},
        {"L1", "/test/l1"},
        {"PSNR (dB)", "/test/psnr_db"},
        {"SSIM", "/test/ssim"},
        {"diversity", "/test/diversity"},
        {"label consistency", "/test/label_consistency/generated", Column::kPercent},
        {"real images (ceiling)", "/test/label_consistency/real", Column::kPercent}},
       {"capspix2pix_compare.png", "capspix2pix_variations.png", "capspix2pix_interpolation.png"}},
  };
  return all;
}

const Kind& kind_of(const nlohmann::json& record) {
  if (record.is_object() && record.contains("task") && record["task"].is_string())
    for (const auto& k : kinds())
      if (!k.task.empty() && k.task == record["task"].get<std::string>()) return k;
  return kinds().front();
}

std::string percent(double v) { return std::isfinite(v) ? fmt::format("{:.2f}%", 100 * v) : "–"; }

// The results row of one run of `kind`: "run", then the kind's columns present in the summary.
nlohmann::json results_row(const Kind& kind, const std::string& run, const nlohmann::json& summary) {
  nlohmann::json row = {{"run", run}};
  for (const auto& c : kind.columns) {
    const nlohmann::json::json_pointer at(c.pointer);
    if (!summary.contains(at)) continue;
    const auto& v = summary[at];
    row[c.header] = v;
    if (c.format == Column::kPercent && v.is_number()) row[c.header] = percent(v.get<double>());
    if (c.format == Column::kCount && v.is_number_integer()) {
      std::string digits = std::to_string(v.get<int64_t>());
      for (int i = int(digits.size()) - 3; i > (digits[0] == '-' ? 1 : 0); i -= 3) digits.insert(size_t(i), ",");
      row[c.header] = digits;
    }
  }
  return row;
}

// Training curves of one metrics.jsonl, drawn as its kind says (by default loss and accuracy by step from
// the train records, test accuracy from the eval records), and the last value of each eval curve.
std::string metrics_section(const fs::path& path, const std::string& name) {
  std::vector<nlohmann::json> records;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json r = parse_untrusted(line);
    // Tolerate a line cut by an interrupted run, or any record of another shape: skip it.
    if (r.is_object() && r.contains("event") && r["event"].is_string()) records.push_back(std::move(r));
  }
  const auto start = std::find_if(records.begin(), records.end(), [](auto& r) { return r["event"] == "start"; });
  const Kind& kind = start == records.end() ? kinds().front() : kind_of(*start);

  std::string charts, last;
  bool any = false;
  for (const auto& chart : kind.charts) {
    std::vector<Series> series;
    for (const auto& c : chart.curves) {
      Series s{c.label, {}, {}};
      for (const auto& r : records)
        if (r["event"] == c.event && r.contains("step") && r["step"].is_number() && r.contains(c.key) &&
            r[c.key].is_number())
          s.x.push_back(r["step"].get<double>()), s.y.push_back(r[c.key].get<double>());
      any = any || !s.x.empty();
      if (std::string(c.event) == "eval" && !s.y.empty())
        last += fmt::format("<p>Last {}: <b>{}</b> at step {}.</p>\n", html_escape(c.label),
                            c.percent ? percent(s.y.back()) : number(s.y.back()), number(s.x.back()));
      series.push_back(std::move(s));
    }
    charts += svg_line_chart(series, "step", chart.y_label);
  }
  std::string html = kind.task.empty() ? fmt::format("<h3>{}</h3>\n", html_escape(name))
                                       : fmt::format("<h3>{} ({})</h3>\n", html_escape(name), html_escape(kind.task));
  if (!any) return html + "<p>No training records yet.</p>\n";
  return html + "<div class=charts>" + charts + "</div>\n" + last;
}

// Bench JSON lines: the summary records (medians + ratios) as tables.
std::string bench_section(const fs::path& path, int& tables) {
  std::string html;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json r = parse_untrusted(line);
    if (!r.is_object() || !r.contains("summary") || r["summary"] != true) continue;
    nlohmann::json medians = nlohmann::json::array(), ratios = nlohmann::json::array();
    const nlohmann::json median = r.value("median", nlohmann::json::object());
    if (!median.is_object()) continue;
    for (auto& [config, m] : median.items()) {
      if (!m.is_object()) continue;
      auto row = m;
      row["configuration"] = config;
      medians.push_back(row);
    }
    const nlohmann::json pairs = r.value("ratios", nlohmann::json::object());  // named: items() must not outlive it
    for (auto& [pair, m] : pairs.items()) {
      if (!m.is_object()) continue;
      auto row = m;
      row["pair"] = pair;
      ratios.push_back(row);
    }
    auto int_at = [&](const char* key) { return r.contains(key) && r[key].is_number() ? r[key].get<double>() : 0.0; };
    html += fmt::format("<p>Medians of {} run(s), batch {}, {} threads.</p>\n", number(int_at("repeats")),
                        number(int_at("batch_size")), number(int_at("threads")));
    html += json_table(medians, {"configuration"}) + json_table(ratios, {"pair"});
    tables += 2;
  }
  return html;
}

}  // namespace

std::string html_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string base64_encode(const std::string& bytes) {
  static const char* const kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t n = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int s : {18, 12, 6, 0}) out += kAlphabet[(n >> s) & 63];
  }
  if (const size_t rest = bytes.size() - i; rest > 0) {
    uint32_t n = uint8_t(bytes[i]) << 16;
    if (rest == 2) n |= uint8_t(bytes[i + 1]) << 8;
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += rest == 2 ? kAlphabet[(n >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string svg_line_chart(const std::vector<Series>& series, const std::string& x_label,
                           const std::string& y_label, int width, int height) {
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : series) {
    if (s.x.size() != s.y.size())
      throw std::invalid_argument(fmt::format("svg_line_chart: series '{}' has {} x and {} y values", s.label,
                                              s.x.size(), s.y.size()));
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, s.x[i]), x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, s.y[i]), y1 = std::max(y1, s.y[i]);
    }
  }
  const int left = 60, right = 12, top = 12, bottom = 40;
  const int pw = width - left - right, ph = height - top - bottom;
  int shown = 0;
  for (const auto& s : series) shown += !s.x.empty();
  height += 14 * shown;  // legend rows below the x label, so they never cover a curve
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "role=\"img\" aria-label=\"{2} by {3}\">\n<rect x=\"{4}\" y=\"{5}\" width=\"{6}\" height=\"{7}\" "
      "fill=\"#fafafa\" stroke=\"#999\"/>\n",
      width, height, html_escape(y_label), html_escape(x_label), left, top, pw, ph);
  if (!(x0 <= x1)) return svg + "<text x=\"70\" y=\"40\">no data</text></svg>\n";
  if (x1 == x0) x0 -= 0.5, x1 += 0.5;
  if (y1 == y0) y0 -= 0.5, y1 += 0.5;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (1 - (y - y0) / (y1 - y0)) * ph; };
  svg += fmt::format(
      "<g font-size=\"11\" font-family=\"sans-serif\" fill=\"#333\">"
      "<text x=\"{0}\" y=\"{1}\" text-anchor=\"start\">{2}</text><text x=\"{3}\" y=\"{1}\" text-anchor=\"end\">{4}</text>"
      "<text x=\"{5}\" y=\"{6}\" text-anchor=\"end\">{7}</text><text x=\"{5}\" y=\"{8}\" text-anchor=\"end\">{9}</text>"
      "<text x=\"{10}\" y=\"{11}\" text-anchor=\"middle\">{12}</text>"
      "<text x=\"12\" y=\"{13}\" text-anchor=\"middle\" transform=\"rotate(-90 12 {13})\">{14}</text></g>\n",
      left, top + ph + 14, number(x0), left + pw, number(x1), left - 4, top + ph, number(y0), top + 10, number(y1),
      left + pw / 2, top + ph + bottom - 6, html_escape(x_label), top + ph / 2, html_escape(y_label));
  int legend_y = top + ph + bottom + 10;
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& s = series[k];
    if (s.x.empty()) continue;
    const char* color = kPalette[k % (sizeof(kPalette) / sizeof(kPalette[0]))];
    std::string points;
    for (size_t i = 0; i < s.x.size(); ++i)
      if (std::isfinite(s.x[i]) && std::isfinite(s.y[i])) points += fmt::format("{:.1f},{:.1f} ", px(s.x[i]), py(s.y[i]));
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.8\" points=\"{}\"/>\n", color, points);
    if (s.x.size() == 1)  // a single point has no line to show
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", px(s.x[0]), py(s.y[0]), color);
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"/>"
        "<text x=\"{4}\" y=\"{5}\" font-size=\"11\" font-family=\"sans-serif\" fill=\"#333\">{6}</text>\n",
        left, legend_y - 4, left + 18, color, left + 24, legend_y, html_escape(s.label));
    legend_y += 14;
  }
  return svg + "</svg>\n";
}

namespace {

std::string json_table_at(const nlohmann::json& value, const std::vector<std::string>& leading_columns, int depth) {
  std::string html = "<table>\n";
  if (value.is_array() && !value.empty() && std::all_of(value.begin(), value.end(), [](auto& v) { return v.is_object(); })) {
    std::vector<std::string> columns;
    for (const auto& c : leading_columns)
      if (std::any_of(value.begin(), value.end(), [&](auto& row) { return row.contains(c); })) columns.push_back(c);
    for (const auto& row : value)
      for (auto& [k, v] : row.items())
        if (std::find(columns.begin(), columns.end(), k) == columns.end()) columns.push_back(k);
    html += "<tr>";
    for (const auto& c : columns) html += "<th>" + html_escape(c) + "</th>";
    html += "</tr>\n";
    for (const auto& row : value) {
      html += "<tr>";
      for (const auto& c : columns) html += "<td>" + (row.contains(c) ? cell(row[c], depth) : std::string()) + "</td>";
      html += "</tr>\n";
    }
  } else if (value.is_object()) {
    for (auto& [k, v] : value.items()) html += "<tr><th>" + html_escape(k) + "</th><td>" + cell(v, depth) + "</td></tr>\n";
  } else if (value.is_array()) {
    // Mixed or nested arrays (e.g. a confusion matrix): one row per element. Recursing into cell()
    // with the array itself would never end.
    for (const auto& v : value) html += "<tr><td>" + cell(v, depth) + "</td></tr>\n";
  } else {
    html += "<tr><td>" + cell(value, depth) + "</td></tr>\n";
  }
  return html + "</table>\n";
}

}  // namespace

std::string json_table(const nlohmann::json& value, const std::vector<std::string>& leading_columns) {
  return json_table_at(value, leading_columns, 0);
}

ReportSummary write_report(const std::string& runs_dir, const std::string& out_path, const std::string& title) {
  if (!fs::is_directory(runs_dir)) throw std::runtime_error("report: not a directory: " + runs_dir);
  std::vector<fs::path> files;
  const auto out_abs = fs::weakly_canonical(out_path);
  for (const auto& e : fs::recursive_directory_iterator(runs_dir, fs::directory_options::skip_permission_denied))
    if (e.is_regular_file() && fs::weakly_canonical(e.path()) != out_abs) files.push_back(e.path());
  std::sort(files.begin(), files.end());

  // Summaries parsed once; a summary named after its kind (e.g. run/capspix2pix.json) owns the kind's
  // figures in its folder: they are drawn together, in the kind's order, captioned by the summary.
  std::map<fs::path, nlohmann::json> parsed;
  std::map<fs::path, const Kind*> owner;
  for (const auto& p : files) {
    if (p.extension() != ".json") continue;
    const auto& j = parsed[p] = parse_untrusted(read_file(p));
    const Kind& kind = kind_of(j);
    if (!kind.task.empty() && p.filename() == kind.task + ".json") owner[p.parent_path()] = &kind;
  }

  ReportSummary summary;
  std::string curves, figures, tables;
  std::vector<nlohmann::json> rows(kinds().size(), nlohmann::json::array());
  auto rel = [&](const fs::path& p) { return fs::relative(p, runs_dir).string(); };
  auto figure = [&](const fs::path& p, const std::string& caption_html) {
    ++summary.figures;
    return fmt::format(
        "<figure><img alt=\"{}\" src=\"data:image/png;base64,{}\"><figcaption>{}</figcaption></figure>\n",
        html_escape(rel(p)), base64_encode(read_file(p)), caption_html);
  };
  const std::string metrics_suffix = ".metrics.jsonl";  // docs/runs keeps a run's metrics as NAME.metrics.jsonl
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() > tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (const auto& p : files) {
    const auto ext = p.extension().string();
    const auto name = p.filename().string();
    if (name == "metrics.jsonl" || ends_with(name, metrics_suffix)) {
      const std::string run = name == "metrics.jsonl" ? rel(p.parent_path())
                                                      : rel(p).substr(0, rel(p).size() - metrics_suffix.size());
      curves += metrics_section(p, run);
      ++summary.runs_with_metrics;
    } else if (ext == ".png") {
      const auto o = owner.find(p.parent_path());
      const auto& theirs = o == owner.end() ? std::vector<std::string>{} : o->second->figures;
      if (std::find(theirs.begin(), theirs.end(), name) == theirs.end()) figures += figure(p, html_escape(rel(p)));
    } else if (ext == ".jsonl") {
      const std::string t = bench_section(p, summary.tables);
      if (!t.empty()) tables += fmt::format("<h3>{}</h3>\n", html_escape(rel(p))) + t;
    } else if (ext == ".json") {
      const auto& j = parsed[p];
      if (j.is_discarded()) continue;
      if (const Kind& kind = kind_of(j); !kind.task.empty()) {
        const bool owns = owner.count(p.parent_path()) && name == kind.task + ".json";
        const std::string run =
            owns && rel(p.parent_path()) != "." ? rel(p.parent_path()) : rel(fs::path(p).replace_extension());
        rows[&kind - kinds().data()].push_back(results_row(kind, run, j));
        std::string group;
        for (const auto& f : owns ? kind.figures : std::vector<std::string>{}) {
          if (!fs::is_regular_file(p.parent_path() / f)) continue;
          std::string caption = html_escape(rel(p.parent_path() / f));
          const auto what = j.value("figures", nlohmann::json::object());  // {name: what it shows}
          if (what.is_object() && what.contains(f) && what[f].is_string())
            caption += ": " + html_escape(what[f].get<std::string>());
          group += figure(p.parent_path() / f, caption);
        }
        if (!group.empty())
          figures += fmt::format("<h3>{} ({})</h3>\n", html_escape(run), html_escape(kind.task)) + group;
      }
      tables += fmt::format("<h3>{}</h3>\n", html_escape(rel(p))) + json_table(j);
      ++summary.tables;
    }
  }
  // One table per recognised kind, a row per run, ahead of the full summaries.
  std::string kind_tables;
  for (size_t k = 0; k < kinds().size(); ++k) {
    if (rows[k].empty()) continue;
    std::vector<std::string> columns{"run"};
    for (const auto& c : kinds()[k].columns) columns.push_back(c.header);
    kind_tables += fmt::format("<h3>{}</h3>\n", html_escape(kinds()[k].title)) + json_table(rows[k], columns);
    ++summary.tables;
  }
  tables = kind_tables + tables;

  std::string page = fmt::format(R"(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{0}</title>
<style>
body {{ font-family: sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 18px; border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }}
h3 {{ font-size: 14px; margin-bottom: 4px; }}
table {{ border-collapse: collapse; margin: 6px 0 16px; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }} th {{ background: #f0f0f0; }}
figure {{ display: inline-block; margin: 8px; vertical-align: top; }} figure img {{ image-rendering: pixelated; max-width: 560px; }}
figcaption {{ font-size: 12px; color: #555; }} .charts svg {{ margin-right: 12px; }}
td .list {{ display: inline-block; max-width: 640px; text-align: left; font-size: 12px; }} td table {{ margin: 0; }}
</style></head><body>
<h1>{0}</h1>
<p>Generated by <code>capsnet report</code> from <code>{1}</code>: {2} training run(s), {3} figure(s), {4} table(s).</p>
<h2>Training curves</h2>
{5}
<h2>Figures</h2>
{6}
<h2>Results</h2>
{7}
</body></html>
)",
                                 html_escape(title), html_escape(runs_dir), summary.runs_with_metrics, summary.figures,
                                 summary.tables, curves.empty() ? "<p>No metrics.jsonl found.</p>" : curves,
                                 figures.empty() ? "<p>No PNG figures found.</p>" : figures,
                                 tables.empty() ? "<p>No JSON results found.</p>" : tables);
  const fs::path out(out_path);
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  std::ofstream o(out_path, std::ios::binary);
  if (!(o << page)) throw std::runtime_error("report: cannot write " + out_path);
  return summary;
}

}  // namespace capsnet::apps
