#include "capsnet/train/zip_bounds.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <vector>

namespace capsnet::train {

uint64_t little_endian(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

namespace {

// Little-endian fields of the zip records (APPNOTE.TXT 4.3.12-4.3.16, 4.5.3).
uint64_t le(const char* p, int bytes) { return little_endian(p, bytes); }

constexpr uint32_t kEndOfDirectory = 0x06054b50, kZip64Locator = 0x07064b50, kZip64End = 0x06064b50,
                   kDirectoryEntry = 0x02014b50;
constexpr size_t kEndSize = 22, kLocatorSize = 20, kZip64EndSize = 56, kEntrySize = 46;
constexpr uint64_t kMax32 = 0xFFFFFFFFu;

struct Directory {
  uint64_t offset = 0, bytes = 0;
};

// Where the central directory is, from the (zip64) end-of-directory records; false when they are not there.
bool find_directory(const ArchiveReader& read, uint64_t size, Directory& dir) {
  if (size < kEndSize) return false;
  // The end record is the last 22 bytes plus a comment of up to 65,535: scan back for its signature.
  const uint64_t tail = std::min<uint64_t>(size, kEndSize + 65535);
  std::vector<char> buf(tail);
  if (!read(size - tail, tail, buf.data())) return false;
  for (uint64_t at = tail - kEndSize + 1; at-- > 0;) {
    const char* e = buf.data() + at;
    if (le(e, 4) != kEndOfDirectory) continue;
    dir.bytes = le(e + 12, 4);
    dir.offset = le(e + 16, 4);
    const uint64_t end_at = size - tail + at;
    if (dir.offset != kMax32 && dir.bytes != kMax32 && le(e + 10, 2) != 0xFFFF) return true;
    // zip64: the locator sits right before the end record and points at the zip64 end record.
    if (end_at < kLocatorSize) return false;
    char loc[kLocatorSize];
    if (!read(end_at - kLocatorSize, kLocatorSize, loc) || le(loc, 4) != kZip64Locator) return false;
    const uint64_t end64_at = le(loc + 8, 8);
    char end64[kZip64EndSize];
    if (end64_at > size || size - end64_at < kZip64EndSize || !read(end64_at, kZip64EndSize, end64) ||
        le(end64, 4) != kZip64End)
      return false;
    dir.bytes = le(end64 + 40, 8);
    dir.offset = le(end64 + 48, 8);
    return true;
  }
  return false;
}

}  // namespace

std::string zip_expansion_problem(const ArchiveReader& read, uint64_t size) {
  Directory dir;
  if (!find_directory(read, size, dir) || dir.offset > size || dir.bytes > size - dir.offset) return "";
  std::vector<char> cd(dir.bytes);
  if (!read(dir.offset, cd.size(), cd.data())) return "";
  uint64_t total = 0;
  for (size_t at = 0; at + kEntrySize <= cd.size();) {
    const char* e = cd.data() + at;
    if (le(e, 4) != kDirectoryEntry) break;
    uint64_t uncompressed = le(e + 24, 4), compressed = le(e + 20, 4);
    const size_t name = le(e + 28, 2), extra = le(e + 30, 2), comment = le(e + 32, 2);
    if (at + kEntrySize + name + extra > cd.size()) break;
    // zip64 sizes: the extra field 0x0001 holds, in order, those of the two that read 0xFFFFFFFF.
    for (size_t x = at + kEntrySize + name, end = x + extra; x + 4 <= end;) {
      const uint64_t id = le(cd.data() + x, 2), len = le(cd.data() + x + 2, 2);
      if (x + 4 + len > end) break;
      if (id == 0x0001) {
        size_t f = x + 4;
        if (uncompressed == kMax32 && f + 8 <= x + 4 + len) uncompressed = le(cd.data() + f, 8), f += 8;
        if (compressed == kMax32 && f + 8 <= x + 4 + len) compressed = le(cd.data() + f, 8);
      }
      x += 4 + len;
    }
    if (uncompressed > size - std::min(total, size))
      return fmt::format("its entries declare more than its {} bytes uncompressed (entry '{}': {} bytes, of which {} "
                         "stored; archives written by LibTorch store their records uncompressed)",
                         size, std::string(e + kEntrySize, std::min<size_t>(name, 80)), uncompressed, compressed);
    total += uncompressed;
    at += kEntrySize + name + extra + comment;
  }
  return "";
}

std::string zip_expansion_problem(const char* data, size_t size) {
  return zip_expansion_problem(
      [data, size](uint64_t offset, size_t n, char* out) {
        if (offset > size || n > size - offset) return false;
        std::memcpy(out, data + offset, n);
        return true;
      },
      size);
}

std::string zip_file_expansion_problem(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return "";
  const auto size = static_cast<uint64_t>(f.tellg());
  return zip_expansion_problem(
      [&f, size](uint64_t offset, size_t n, char* out) {
        if (offset > size || n > size - offset) return false;
        f.seekg(static_cast<std::streamoff>(offset));
        return static_cast<bool>(f.read(out, static_cast<std::streamsize>(n)));
      },
      size);
}

}  // namespace capsnet::train
