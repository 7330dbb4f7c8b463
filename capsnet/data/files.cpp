#include "capsnet/data/files.h"

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

}  // namespace capsnet::data
