#include "capsnet/data/idx.h"

#include <fmt/format.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

namespace capsnet::data {

namespace {

constexpr uint8_t kTypeUByte = 0x08;
constexpr int kMaxDims = 4;
constexpr size_t kMaxHeader = 4 + 4 * kMaxDims;
// A .gz cannot be sized before inflating it; the bound keeps a gzip bomb from exhausting memory.
constexpr size_t kMaxGzBytes = size_t{1} << 30;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw IdxError(path + ": " + what);
}

bool is_gz(const std::string& path) {
  return path.size() >= 3 && path.compare(path.size() - 3, 3, ".gz") == 0;
}

std::string join_dims(const std::vector<int64_t>& dims) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? "x" : "") + std::to_string(dims[i]);
  return s;
}

struct Header {
  std::vector<int64_t> dims;
  size_t size = 0;        // header bytes
  uint64_t data_bytes = 0;
};

// Validates the header in bytes[0, available) of a file `total` bytes long, before any data
// buffer is allocated, so a corrupt header cannot trigger a huge allocation.
Header parse_header(const std::string& path, const uint8_t* bytes, size_t available, uint64_t total) {
  if (available < 4)
    fail(path, fmt::format("truncated header: the file holds {} bytes, an IDX header needs at least 4",
                           total));
  if (bytes[0] != 0 || bytes[1] != 0)
    fail(path, fmt::format("bad magic 0x{:02X}{:02X} (not an IDX file)", bytes[0], bytes[1]));
  if (bytes[2] != kTypeUByte)
    fail(path, fmt::format("unsupported IDX data type 0x{:02X} (only 0x08, unsigned byte, is supported)",
                           bytes[2]));
  const int ndims = bytes[3];
  if (ndims < 1 || ndims > kMaxDims)
    fail(path, fmt::format("unsupported number of dimensions {} (must be 1 to {})", ndims, kMaxDims));

  Header h;
  h.size = 4 + 4 * static_cast<size_t>(ndims);
  if (available < h.size)
    fail(path, fmt::format("truncated header: {} dimensions need {} header bytes but the file holds {}",
                           ndims, h.size, total));
  bool overflow = false;
  h.data_bytes = 1;
  for (int i = 0; i < ndims; ++i) {
    const uint8_t* p = bytes + 4 + 4 * i;
    const uint64_t d = (uint64_t{p[0]} << 24) | (uint64_t{p[1]} << 16) | (uint64_t{p[2]} << 8) | p[3];
    if (d == 0) fail(path, fmt::format("dimension {} is 0 (every dimension must be positive)", i));
    h.dims.push_back(static_cast<int64_t>(d));
    overflow = overflow || __builtin_mul_overflow(h.data_bytes, d, &h.data_bytes);
  }
  const uint64_t held = total - h.size;
  if (overflow)
    fail(path, fmt::format("truncated: header declares more than 2^64 bytes of data ({}) but the file holds {}",
                           join_dims(h.dims), held));
  if (held < h.data_bytes)
    fail(path, fmt::format("truncated: header declares {} bytes of data ({}) but the file holds {}",
                           h.data_bytes, join_dims(h.dims), held));
  if (held > h.data_bytes)
    fail(path, fmt::format("{} unexpected trailing bytes after the data (header declares {} bytes, {})",
                           held - h.data_bytes, h.data_bytes, join_dims(h.dims)));
  return h;
}

torch::Tensor read_plain(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) fail(path, std::string("cannot open: ") + std::strerror(errno));
  std::error_code ec;
  const auto total = std::filesystem::file_size(path, ec);
  if (ec) fail(path, "cannot determine the file size: " + ec.message());

  uint8_t head[kMaxHeader];
  const size_t got = std::fread(head, 1, sizeof(head), f.get());
  const Header h = parse_header(path, head, got, total);

  auto out = torch::empty(h.dims, torch::kUInt8);
  if (std::fseek(f.get(), static_cast<long>(h.size), SEEK_SET) != 0 ||
      std::fread(out.data_ptr<uint8_t>(), 1, h.data_bytes, f.get()) != h.data_bytes)
    fail(path, "read error: the file changed or could not be read while loading");
  return out;
}

torch::Tensor read_gz(const std::string& path) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> f(gzopen(path.c_str(), "rb"), &gzclose_r);
  if (!f) fail(path, std::string("cannot open: ") + std::strerror(errno ? errno : ENOMEM));

  std::vector<uint8_t> bytes;
  constexpr unsigned kChunk = 1u << 20;
  for (;;) {
    const size_t old = bytes.size();
    bytes.resize(old + kChunk);
    const int n = gzread(f.get(), bytes.data() + old, kChunk);
    if (n < 0) {
      int err = 0;
      fail(path, std::string("corrupt gzip data: ") + gzerror(f.get(), &err));
    }
    bytes.resize(old + static_cast<size_t>(n));
    if (bytes.size() > kMaxGzBytes)
      fail(path, fmt::format("decompresses to more than {} bytes; refusing to load it", kMaxGzBytes));
    if (n == 0) break;
  }
  // A stream cut short ends "successfully" with a short read; zlib reports it only here.
  int err = Z_OK;
  const char* msg = gzerror(f.get(), &err);
  if (err != Z_OK) fail(path, std::string("corrupt gzip data: ") + msg);

  const Header h = parse_header(path, bytes.data(), std::min(bytes.size(), kMaxHeader), bytes.size());
  auto out = torch::empty(h.dims, torch::kUInt8);
  std::memcpy(out.data_ptr<uint8_t>(), bytes.data() + h.size, h.data_bytes);
  return out;
}

}  // namespace

torch::Tensor read_idx(const std::string& path) {
  std::error_code ec;
  // fopen/gzopen succeed on a directory on Linux; the failure would only surface as a read error.
  if (std::filesystem::is_directory(path, ec)) fail(path, "cannot open: is a directory");
  return is_gz(path) ? read_gz(path) : read_plain(path);
}

void write_idx(const std::string& path, const torch::Tensor& data) {
  if (data.scalar_type() != torch::kUInt8)
    fail(path, fmt::format("write_idx needs a uint8 tensor, got {}", c10::toString(data.scalar_type())));
  if (data.dim() < 1 || data.dim() > kMaxDims)
    fail(path, fmt::format("write_idx needs 1 to {} dimensions, got {}", kMaxDims, data.dim()));
  std::vector<uint8_t> header = {0, 0, kTypeUByte, static_cast<uint8_t>(data.dim())};
  for (int64_t d : data.sizes()) {
    if (d <= 0 || d > int64_t{0xFFFFFFFF})
      fail(path, fmt::format("write_idx: dimension size {} does not fit an IDX header (1 to 2^32-1)", d));
    for (int shift = 24; shift >= 0; shift -= 8) header.push_back(static_cast<uint8_t>(d >> shift));
  }
  const auto bytes = data.cpu().contiguous();
  const auto n = static_cast<size_t>(bytes.numel());
  const auto* ptr = bytes.data_ptr<uint8_t>();

  if (is_gz(path)) {
    gzFile f = gzopen(path.c_str(), "wb");
    if (!f) fail(path, std::string("cannot create: ") + std::strerror(errno ? errno : ENOMEM));
    bool ok = gzwrite(f, header.data(), static_cast<unsigned>(header.size())) == static_cast<int>(header.size());
    // gzwrite takes an unsigned length: write large tensors in pieces.
    for (size_t off = 0; ok && off < n; off += size_t{1} << 30) {
      const auto len = static_cast<unsigned>(std::min(n - off, size_t{1} << 30));
      ok = gzwrite(f, ptr + off, len) == static_cast<int>(len);
    }
    if (gzclose_w(f) != Z_OK || !ok) fail(path, "write error");
    return;
  }
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) fail(path, std::string("cannot create: ") + std::strerror(errno));
  bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(ptr, 1, n, f) == n;
  if (std::fclose(f) != 0 || !ok) fail(path, std::string("write error: ") + std::strerror(errno));
}

}  // namespace capsnet::data
