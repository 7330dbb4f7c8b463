#include "capsnet/data/files.h"

#include <fmt/format.h>

#include <filesystem>
#include <system_error>

namespace capsnet::data {

std::string unreadable_reason(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(path, ec);  // follows symlinks
  if (ec && ec != std::errc::no_such_file_or_directory) return ec.message();
  if (fs::is_directory(st)) return "is a directory";
  if (fs::exists(st) && !fs::is_regular_file(st)) return "not a regular file (a FIFO, socket or device)";
  return "";
}

std::string unwritable_reason(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) return ec.message();
  if (!fs::exists(st) || fs::is_regular_file(st) || fs::is_character_file(st)) return "";
  if (fs::is_directory(st)) return "is a directory";
  return "is a FIFO, socket or block device";
}

bool exists_but_not_regular(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(path, ec);
  return fs::exists(st) && !fs::is_regular_file(st);
}

namespace {

// Length of the valid UTF-8 sequence at text[i] (1-4), or 0 when none starts there: no overlong forms, no
// surrogates, nothing above U+10FFFF (RFC 3629, as nlohmann's writer checks).
size_t utf8_sequence(std::string_view text, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  else return 0;
  if (i + n > text.size() || at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (at(i + k) < 0x80 || at(i + k) > 0xBF) return 0;
  return n;
}

}  // namespace

std::string escape_invalid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (const size_t n = utf8_sequence(text, i)) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += fmt::format("\\x{:02X}", static_cast<unsigned char>(text[i]));
      ++i;
    }
  }
  return out;
}

}  // namespace capsnet::data
