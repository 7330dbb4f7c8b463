// capsnet report: the HTML page builder (charts, tables, escaping, embedded PNGs) and the CLI.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "capsnet/viz/png.h"
#include "apps/report.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::run_command;
const std::string kCli = CAPSNET_CLI;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

TEST(ReportTest, Base64MatchesRfc4648Vectors) {
  EXPECT_EQ(apps::base64_encode(""), "");
  EXPECT_EQ(apps::base64_encode("f"), "Zg==");
  EXPECT_EQ(apps::base64_encode("fo"), "Zm8=");
  EXPECT_EQ(apps::base64_encode("foo"), "Zm9v");
  EXPECT_EQ(apps::base64_encode("foob"), "Zm9vYg==");
  EXPECT_EQ(apps::base64_encode("fooba"), "Zm9vYmE=");
  EXPECT_EQ(apps::base64_encode("foobar"), "Zm9vYmFy");
  EXPECT_EQ(apps::base64_encode(std::string("\xff\x00\x80", 3)), "/wCA");
}

TEST(ReportTest, HtmlEscapeNeutralisesMarkup) {
  EXPECT_EQ(apps::html_escape("<script>alert('x') & \"y\"</script>"),
            "&lt;script&gt;alert(&#39;x&#39;) &amp; &quot;y&quot;&lt;/script&gt;");
}

TEST(ReportTest, ChartMapsExtremesToThePlotCorners) {
  // 560x260 with margins left 60, right 12, top 12, bottom 40: plot area x in [60, 548], y in [12, 220].
  const auto svg = apps::svg_line_chart({{"loss", {0, 10}, {1, 3}}}, "step", "loss");
  EXPECT_NE(svg.find("points=\"60.0,220.0 548.0,12.0 \""), std::string::npos) << svg;
  EXPECT_EQ(count(svg, "<polyline"), 1u);
  EXPECT_NE(svg.find(">loss</text>"), std::string::npos);
  EXPECT_THROW(apps::svg_line_chart({{"bad", {0, 1}, {1}}}, "x", "y"), std::invalid_argument);
  // Empty series are skipped; all-empty gives a placeholder, not a crash.
  EXPECT_NE(apps::svg_line_chart({{"none", {}, {}}}, "x", "y").find("no data"), std::string::npos);
}

TEST(ReportTest, JsonTableHasOneRowPerObjectAndUnionOfScalarColumns) {
  auto rows = nlohmann::json::parse(R"([{"r":1,"error":0.01},{"r":3,"error":0.008,"note":"<b>"}])");
  const auto html = apps::json_table(rows);
  EXPECT_EQ(count(html, "<tr>"), 3u);  // header + 2 rows
  // nlohmann::json keeps object keys sorted, so "error" comes before "r" unless asked to lead.
  EXPECT_NE(html.find("<th>error</th><th>r</th><th>note</th>"), std::string::npos) << html;
  EXPECT_NE(apps::json_table(rows, {"r", "absent"}).find("<th>r</th><th>error</th><th>note</th>"), std::string::npos);
  EXPECT_NE(html.find("<td>0.008</td>"), std::string::npos) << html;
  EXPECT_NE(html.find("&lt;b&gt;"), std::string::npos);
  EXPECT_EQ(html.find("<b>"), std::string::npos);
  // Nested values: a list of numbers is shown as a list, an object as a table inside the cell.
  auto nested = apps::json_table(nlohmann::json::parse(R"({"dims":[0.5,0.25],"inner":{"k":1}})"));
  EXPECT_NE(nested.find("[0.5, 0.25]"), std::string::npos) << nested;
  EXPECT_NE(nested.find("<td><table>\n<tr><th>k</th><td>1</td></tr>\n</table>\n</td>"), std::string::npos) << nested;
}

TEST(ReportTest, PageGathersCurvesFiguresAndTables) {
  testing::TempDir dir;
  const std::string runs = dir / "runs";
  std::filesystem::create_directories(runs + "/mnist");
  {
    std::ofstream m(runs + "/mnist/metrics.jsonl");
    m << R"({"event":"start","step":0})" << '\n';
    for (int s = 1; s <= 4; ++s)
      m << nlohmann::json{{"event", "train"}, {"step", s * 10}, {"loss", 1.0 / s}, {"accuracy", 0.2 * s}}.dump()
        << '\n';
    m << R"({"event":"eval","step":40,"accuracy":0.9123})" << '\n';
    m << R"({"event":"train","step":5)";  // a line cut off by an interrupted run is ignored
  }
  viz::write_png_gray(runs + "/mnist/figure.png", torch::rand({8, 6}));
  std::ofstream(runs + "/ablation.json") << R"([{"r":1,"test_error":0.012},{"r":3,"test_error":0.011}])";
  std::ofstream(runs + "/bench.jsonl")
      << R"({"config":"fused","train_img_s":90})" << '\n'
      << R"({"summary":true,"repeats":3,"batch_size":100,"threads":2,"median":{"fused":{"train_img_s":92.3}},)"
      << R"("ratios":{"fused/peer":{"train_speedup":2.32}}})" << '\n';

  const std::string out = runs + "/report.html";
  const auto s = apps::write_report(runs, out, "T<1>");
  EXPECT_EQ(s.runs_with_metrics, 1);
  EXPECT_EQ(s.figures, 1);
  EXPECT_EQ(s.tables, 3);  // ablation.json + bench medians + bench ratios
  const auto html = slurp(out);
  EXPECT_NE(html.find("<title>T&lt;1&gt;</title>"), std::string::npos);
  EXPECT_EQ(count(html, "<svg"), 2u);  // loss chart + accuracy chart
  EXPECT_NE(html.find("Last test accuracy: <b>91.23%</b> at step 40"), std::string::npos);
  EXPECT_NE(html.find("data:image/png;base64,iVBORw0KGgo"), std::string::npos);  // PNG signature
  EXPECT_NE(html.find("<td>92.3</td>"), std::string::npos);
  EXPECT_NE(html.find("<td>fused/peer</td>"), std::string::npos);
  // Writing the page again over the old one (inside the scanned dir) does not embed itself.
  apps::write_report(runs, out, "T<1>");
  EXPECT_EQ(slurp(out), html);
}

TEST(ReportTest, CliWritesThePageAndRejectsAMissingDirectory) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir / "runs");
  std::ofstream(dir / "runs/result.json") << R"({"accuracy":0.99})";
  auto r = run_command(kCli + " report --runs " + (dir / "runs") + " --out " + (dir / "out/page.html"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("0 training run(s), 0 figure(s), 1 table(s)"), std::string::npos) << r.output;
  EXPECT_NE(slurp(dir / "out/page.html").find("<th>accuracy</th><td>0.99</td>"), std::string::npos);
  r = run_command(kCli + " report --runs " + (dir / "nope"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("not a directory"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace capsnet
