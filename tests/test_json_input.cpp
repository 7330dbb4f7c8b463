// train/json_input.h: one nesting limit for every JSON capsnet reads, checked on the text before parsing
// (a value nested 10^6 deep crashed eval, resume, predict, report and serve in recursive walks).
#include <gtest/gtest.h>

#include <string>

#include "capsnet/models/capsnet.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/json_input.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

std::string nested(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST(JsonInput, DepthCountsBracketsOutsideStringsOnly) {
  EXPECT_EQ(train::json_nesting_depth("{}"), 1);
  EXPECT_EQ(train::json_nesting_depth("1"), 0);
  EXPECT_EQ(train::json_nesting_depth(R"({"a": [[1], {"b": []}]})"), 4);
  EXPECT_EQ(train::json_nesting_depth(R"({"a": "[[[[{{{{", "b": "\"[[["})"), 1);
  EXPECT_EQ(train::json_nesting_depth(nested(1000000)), 1000000);
}

TEST(JsonInput, TheLimitIsSixtyFourLevels) {
  const auto ok = train::parse_json_or_discarded(nested(train::kMaxJsonDepth));
  ASSERT_FALSE(ok.is_discarded());
  EXPECT_EQ(train::parse_json(nested(train::kMaxJsonDepth), "t"), ok);
  EXPECT_TRUE(train::parse_json_or_discarded(nested(train::kMaxJsonDepth + 1)).is_discarded());
  EXPECT_TRUE(train::parse_json_or_discarded(nested(1000000)).is_discarded());  // no crash, no parse
  EXPECT_TRUE(train::parse_json_or_discarded("{\"a\": ").is_discarded());
  try {
    train::parse_json(nested(1000000), "card X");
    FAIL() << "expected a refusal";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "card X: JSON nested deeper than 64 levels");
  }
  try {
    train::parse_json("{\"a\": ", "card X");
    FAIL() << "expected a refusal";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("card X: not JSON (", 0), 0u) << e.what();
  }
}

// A checkpoint whose meta nests deeper than the limit is "corrupt", as any other bad meta: resume,
// eval, predict and export read it through read_checkpoint_meta.
TEST(JsonInput, ACheckpointMetaNestedTooDeepIsCorrupt) {
  testing::TempDir dir;
  models::CapsNet model(testing::tiny_config());
  nlohmann::json options = nlohmann::json::parse(nested(100));
  const auto path = dir / "deep.pt";
  train::save_checkpoint(path, *model, nullptr, {1, model->config.to_json(), {{"deep", options}}});
  try {
    train::read_checkpoint_meta(path);
    FAIL() << "expected CheckpointError";
  } catch (const train::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("64 levels"), std::string::npos) << e.what();
  }
  // The same checkpoint with a shallow meta reads.
  train::save_checkpoint(path, *model, nullptr, {1, model->config.to_json(), {{"deep", nested(3)}}});
  EXPECT_EQ(train::read_checkpoint_meta(path).step, 1);
}

}  // namespace
}  // namespace capsnet
