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

// A CapsPix2pix run as `capsnet capspix2pix` leaves it (metrics.jsonl, capspix2pix.json, the three
// figures), and one kept as docs/runs does (NAME.json + NAME.metrics.jsonl, no figures).
TEST(ReportTest, CapsPix2pixRunsGetTheirRowCurvesAndFigures) {
  testing::TempDir dir;
  const std::string runs = dir / "runs";
  std::filesystem::create_directories(runs + "/p2p/caps");
  auto metrics = [](const std::string& path, double test_l1, int last_step) {
    std::ofstream m(path);
    m << R"({"event":"start","step":0,"task":"capspix2pix","model":{"generator":"caps"}})" << '\n';
    for (int s = 1; s <= 3; ++s)
      m << nlohmann::json{{"event", "train"}, {"step", 100 * s}, {"loss", 60.0 / s}, {"d_loss", 0.5 / s},
                          {"g_gan", 1.0 + s}, {"l1", 0.6 / s}}.dump()
        << '\n';
    m << nlohmann::json{{"event", "eval"}, {"split", "test"}, {"step", last_step}, {"l1", test_l1}, {"psnr", 18.2}}
             .dump()
      << '\n';
  };
  auto summary = [](const std::string& generator, int64_t params, int steps, double l1, double psnr, double ssim,
                    double diversity) {
    return nlohmann::json{{"task", "capspix2pix"},
                          {"generator", generator},
                          {"generator_parameters", params},
                          {"discriminator_parameters", 136769},
                          {"steps", steps},
                          {"batch_size", 16},
                          {"images_seen", steps * 16},
                          {"train_seconds", 660.5},
                          {"test",
                           {{"maps", 500}, {"l1", l1}, {"psnr_db", psnr}, {"ssim", ssim}, {"diversity", diversity}}}};
  };
  metrics(runs + "/p2p/caps/metrics.jsonl", 0.1019, 963);
  auto caps = summary("caps", 74977, 963, 0.1019, 18.23, 0.585, 0.0078);
  caps["test"]["label_consistency"] = {{"generated", 0.644}, {"real", 0.754}};
  for (const char* f : {"compare", "variations", "interpolation"}) {
    const std::string name = std::string("capspix2pix_") + f + ".png";
    viz::write_png_gray(runs + "/p2p/caps/" + name, torch::rand({8, 6}));
    caps["figures"][name] = std::string("the <") + f + "> figure";
  }
  viz::write_png_gray(runs + "/p2p/caps/other.png", torch::rand({4, 4}));  // not the kind's: a plain figure
  std::ofstream(runs + "/p2p/caps/capspix2pix.json") << caps.dump(2);
  metrics(runs + "/p2p/cnn.metrics.jsonl", 0.0794, 596);
  std::ofstream(runs + "/p2p/cnn.json") << summary("cnn", 1023873, 596, 0.0794, 18.37, 0.625, 0.0525).dump(2);

  const auto s = apps::write_report(runs, dir / "page.html", "p2p");
  EXPECT_EQ(s.runs_with_metrics, 2);
  EXPECT_EQ(s.figures, 4);
  EXPECT_EQ(s.tables, 3);  // the CapsPix2pix table + the two full summaries
  const auto html = slurp(dir / "page.html");

  // The results table: one row per run, columns in the kind's order, label consistency only where scored.
  EXPECT_NE(html.find("<h3>CapsPix2pix and pix2pix (capsnet capspix2pix, docs/capspix2pix.md)</h3>\n<table>\n"
                      "<tr><th>run</th><th>generator</th><th>G parameters</th><th>D parameters</th><th>steps</th>"
                      "<th>batch</th><th>images</th><th>test maps</th><th>L1</th><th>PSNR (dB)</th>"
                      "<th>SSIM</th><th>diversity</th><th>label consistency</th><th>real images (ceiling)</th></tr>\n"
                      "<tr><td>p2p/caps</td><td>caps</td><td>74,977</td><td>136,769</td><td>963</td><td>16</td>"
                      "<td>15,408</td><td>500</td><td>0.1019</td><td>18.23</td><td>0.585</td>"
                      "<td>0.0078</td><td>64.40%</td><td>75.40%</td></tr>\n"
                      "<tr><td>p2p/cnn</td><td>cnn</td><td>1,023,873</td><td>136,769</td><td>596</td><td>16</td>"
                      "<td>9,536</td><td>500</td><td>0.0794</td><td>18.37</td><td>0.625</td>"
                      "<td>0.0525</td><td></td><td></td></tr>\n</table>\n"),
            std::string::npos)
      << html;
  // It leads the Results section, ahead of the full summaries.
  EXPECT_LT(html.find("<h3>CapsPix2pix and pix2pix"), html.find("<h3>p2p/caps/capspix2pix.json</h3>"));

  // Curves: generator L1 (train and test) and the GAN losses, for both layouts; no accuracy chart.
  EXPECT_NE(html.find("<h3>p2p/caps (capspix2pix)</h3>\n<div class=charts>"), std::string::npos);
  EXPECT_NE(html.find("<h3>p2p/cnn (capspix2pix)</h3>\n<div class=charts>"), std::string::npos);
  EXPECT_EQ(count(html, "aria-label=\"generator L1 by step\""), 2u);
  EXPECT_EQ(count(html, "aria-label=\"GAN loss (BCE) by step\""), 2u);
  EXPECT_EQ(count(html, "<svg"), 4u);
  for (const char* legend :
       {">train L1</text>", ">test L1</text>", ">discriminator</text>", ">generator GAN term</text>"})
    EXPECT_EQ(count(html, legend), 2u) << legend;
  EXPECT_NE(html.find("Last test L1: <b>0.1019</b> at step 963."), std::string::npos);
  EXPECT_NE(html.find("Last test L1: <b>0.0794</b> at step 596."), std::string::npos);

  // Figures: the run's three, once each, in the seed's order, captioned by the summary; others stay plain.
  const auto compare = html.find("alt=\"p2p/caps/capspix2pix_compare.png\"");
  const auto variations = html.find("alt=\"p2p/caps/capspix2pix_variations.png\"");
  const auto interpolation = html.find("alt=\"p2p/caps/capspix2pix_interpolation.png\"");
  ASSERT_NE(interpolation, std::string::npos);
  EXPECT_LT(html.find("<h2>Figures</h2>\n<h3>p2p/caps (capspix2pix)</h3>\n<figure>"), compare);
  EXPECT_LT(compare, variations);
  EXPECT_LT(variations, interpolation);
  EXPECT_EQ(count(html, "capspix2pix_compare.png\" src=\"data:image/png;base64,iVBORw0KGgo"), 1u);
  EXPECT_NE(html.find("<figcaption>p2p/caps/capspix2pix_variations.png: the &lt;variations&gt; figure</figcaption>"),
            std::string::npos);
  EXPECT_NE(html.find("<figcaption>p2p/caps/other.png</figcaption>"), std::string::npos);
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
