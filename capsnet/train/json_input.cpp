#include "capsnet/train/json_input.h"

#include "capsnet/data/files.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace capsnet::train {

int json_nesting_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

nlohmann::json parse_json_or_discarded(std::string_view text) {
  if (json_nesting_depth(text) > kMaxJsonDepth) return nlohmann::json(nlohmann::json::value_t::discarded);
  return nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
}

nlohmann::json parse_json(std::string_view text, const std::string& what) {
  if (json_nesting_depth(text) > kMaxJsonDepth)
    throw std::invalid_argument(fmt::format("{}: JSON nested deeper than {} levels", what, kMaxJsonDepth));
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(fmt::format("{}: not JSON ({})", what, e.what()));
  }
}

nlohmann::json read_json_file(const std::string& path) {
  if (const auto why = data::unreadable_reason(path); !why.empty())
    throw std::invalid_argument(fmt::format("{}: cannot be read: {}", path, why));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(fmt::format("{}: cannot be read", path));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_json(text.str(), path);
}

}  // namespace capsnet::train
