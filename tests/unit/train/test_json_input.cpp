// train/json_input.h: one nesting limit for every JSON capsnet reads, checked on the text before parsing
// (a value nested 10^6 deep crashed eval, resume, predict, report and serve in recursive walks).
#include <gtest/gtest.h>

#include <string>

#include "capsnet/data/files.h"
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

TEST(JsonInput, BytesThatAreNotUtf8AreEscapedAndValidTextIsLeftAsItIs) {
  // Valid: ASCII, 2-, 3- and 4-byte sequences (é, €, U+1F600).
  const std::string valid = "a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80z";
  EXPECT_EQ(data::escape_invalid_utf8(valid), valid);
  EXPECT_EQ(data::escape_invalid_utf8(""), "");
  // Invalid: a Latin-1 byte, a lone continuation, an overlong '/', a surrogate, beyond U+10FFFF, cut short.
  EXPECT_EQ(data::escape_invalid_utf8("caf\xe9"), "caf\\xE9");
  EXPECT_EQ(data::escape_invalid_utf8("\x80" "a"), "\\x80a");
  EXPECT_EQ(data::escape_invalid_utf8("\xc0\xaf"), "\\xC0\\xAF");
  EXPECT_EQ(data::escape_invalid_utf8("\xed\xa0\x80"), "\\xED\\xA0\\x80");
  EXPECT_EQ(data::escape_invalid_utf8("\xf4\x90\x80\x80"), "\\xF4\\x90\\x80\\x80");
  EXPECT_EQ(data::escape_invalid_utf8("\xe2\x82"), "\\xE2\\x82");
  EXPECT_EQ(data::escape_invalid_utf8("\xe2\x82" "a\xe2\x82\xac"), "\\xE2\\x82a\xe2\x82\xac");

  // dump_json writes what nlohmann refuses (type_error 316), in keys and values at any depth.
  nlohmann::json j{{"caf\xe9", {{"names", {"ok", "x\xff"}}}}, {"n", 1}};
  EXPECT_THROW(j.dump(), nlohmann::json::type_error);
  const auto text = train::dump_json(j);
  const auto back = nlohmann::json::parse(text);
  EXPECT_EQ(back, (nlohmann::json{{"caf\\xE9", {{"names", {"ok", "x\\xFF"}}}}, {"n", 1}}));
  EXPECT_EQ(train::with_valid_utf8(j), back);
  const nlohmann::json fine{{"a", {1, "b\xc3\xa9"}}};
  EXPECT_EQ(train::dump_json(fine, 2), fine.dump(2));
}

}  // namespace
}  // namespace capsnet
