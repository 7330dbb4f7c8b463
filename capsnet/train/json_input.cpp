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

nlohmann::json with_valid_utf8(const nlohmann::json& j) {
  if (j.is_string()) return data::escape_invalid_utf8(j.get_ref<const std::string&>());
  if (j.is_array()) {
    auto out = nlohmann::json::array();
    for (const auto& e : j) out.push_back(with_valid_utf8(e));
    return out;
  }
  if (j.is_object()) {
    auto out = nlohmann::json::object();
    for (const auto& [key, value] : j.items()) out[data::escape_invalid_utf8(key)] = with_valid_utf8(value);
    return out;
  }
  return j;
}

std::string dump_json(const nlohmann::json& j, int indent) {
  try {
    return j.dump(indent);
  } catch (const nlohmann::json::type_error&) {  // 316: a string that is not UTF-8
    return with_valid_utf8(j).dump(indent);
  }
}

}  // namespace capsnet::train
