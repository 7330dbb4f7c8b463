// capsnet ablation: the r x reconstruction grid, its table and JSON, and reuse of finished runs.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "cli_helpers.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::run_command;
const std::string kCli = CAPSNET_CLI;

TEST(AblationCliTest, TrainsEveryCombinationWritesTableAndReusesFinishedRuns) {
  testing::TempDir dir;
  const std::string data = dir / "mnist", out = dir / "ablation";
  testing::write_fake_mnist(data, 32, 16);
  const std::string cmd = kCli + " ablation --data " + data + " --out " + out +
                          " --routing 1,2 --steps 2 --batch-size 8 --no-progress";
  auto r = run_command(cmd);
  ASSERT_EQ(r.status, 0) << r.output;

  auto results = nlohmann::json::parse(std::ifstream(out + "/ablation.json"));
  ASSERT_EQ(results.size(), 4u);
  std::vector<std::pair<int64_t, bool>> grid;
  for (const auto& j : results) {
    grid.emplace_back(j.at("routing_iterations").get<int64_t>(), j.at("reconstruction").get<bool>());
    EXPECT_EQ(j.at("steps").get<int64_t>(), 2);
    EXPECT_DOUBLE_EQ(j.at("epochs_seen").get<double>(), 0.5);  // 2 steps x 8 of 32 images
    EXPECT_EQ(j.at("test_examples").get<int64_t>(), 16);
    const double err = j.at("test_error").get<double>();
    EXPECT_GE(err, 0.0);
    EXPECT_LE(err, 1.0);
  }
  EXPECT_EQ(grid, (std::vector<std::pair<int64_t, bool>>{{1, true}, {1, false}, {2, true}, {2, false}}));
  EXPECT_EQ(results[0].at("paper_test_error_percent"), "0.29");
  EXPECT_EQ(results[1].at("paper_test_error_percent"), "0.34");
  EXPECT_EQ(results[2].at("paper_test_error_percent"), "–");

  std::ifstream md(out + "/ablation.md");
  std::string line;
  int rows = 0;
  while (std::getline(md, line)) rows += line.rfind("| ", 0) == 0 && line.find("---") == std::string::npos;
  EXPECT_EQ(rows, 5);  // header + 4 runs
  std::ifstream md2(out + "/ablation.md");
  const std::string table((std::istreambuf_iterator<char>(md2)), std::istreambuf_iterator<char>());
  EXPECT_NE(table.find("| 0.29% |"), std::string::npos) << table;
  EXPECT_NE(table.find("| – |"), std::string::npos) << table;  // r = 2: not in the paper
  EXPECT_EQ(table.find("–%"), std::string::npos) << table;

  // Same settings again: every run is reused, the results are identical.
  auto again = run_command(cmd);
  ASSERT_EQ(again.status, 0) << again.output;
  size_t reused = 0;
  for (size_t p = again.output.find("reusing"); p != std::string::npos; p = again.output.find("reusing", p + 1)) ++reused;
  EXPECT_EQ(reused, 4u) << again.output;
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(out + "/ablation.json")), results);
}

TEST(AblationCliTest, RejectsBadGridValues) {
  EXPECT_TRUE(testing::FailsSaying(testing::run_cli("ablation --reconstruction maybe"), "maybe"));
  EXPECT_NE(testing::run_cli("ablation --routing 0").status, 0);
}

}  // namespace
}  // namespace capsnet
