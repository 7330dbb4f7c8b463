#pragma once
// JSON read from files and requests that may be hostile: one nesting limit, checked on the text before
// it is parsed. nlohmann's parser is iterative, but comparing, copying, dumping and destroying a value
// recurse once per level: a checkpoint meta or a request nested 10^6 deep crashed the process.

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace capsnet::train {

/// Deeper nesting of arrays and objects than any file capsnet writes (< 10) by far, and shallow enough
/// for every recursive walk over a value.
inline constexpr int kMaxJsonDepth = 64;

/// Deepest nesting of arrays and objects in JSON text (brackets inside strings do not count).
int json_nesting_depth(std::string_view text);

/// text -> JSON, or a discarded value (is_discarded()) when it is malformed or nested deeper than
/// kMaxJsonDepth. Never throws on any text.
nlohmann::json parse_json_or_discarded(std::string_view text);

/// text -> JSON; throws std::invalid_argument "<what>: not JSON (...)" when malformed and "<what>: JSON
/// nested deeper than 64 levels" when too deep, before parsing.
nlohmann::json parse_json(std::string_view text, const std::string& what);

/// j with data::escape_invalid_utf8 (data/files.h) applied to every string and object key.
nlohmann::json with_valid_utf8(const nlohmann::json& j);
/// j.dump(indent), with strings that are not UTF-8 written escaped (above) instead of throwing.
std::string dump_json(const nlohmann::json& j, int indent = -1);

/// A whole file's text, then parse_json (what = "<path>"); throws std::invalid_argument naming the path
/// when it cannot be read.
nlohmann::json read_json_file(const std::string& path);

}  // namespace capsnet::train
