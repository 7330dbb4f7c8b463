#include "capsnet/data/idx.h"

#include "capsnet/data/files.h"

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
constexpr size_t kMaxGzBytes = size_t{512} << 20;

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

// The header's dimensions and sizes without checking them against a file size (for streams).
Header parse_header_dims_only(const std::string& path, const uint8_t* bytes, size_t available) {
  if (available >= 4 && bytes[3] >= 1 && bytes[3] <= kMaxDims && available >= 4 + 4 * size_t{bytes[3]}) {
    uint64_t data = 1;
    bool overflow = false;
    for (int i = 0; i < bytes[3]; ++i) {
      const uint8_t* p = bytes + 4 + 4 * i;
      const uint64_t d = (uint64_t{p[0]} << 24) | (uint64_t{p[1]} << 16) | (uint64_t{p[2]} << 8) | p[3];
      overflow = overflow || __builtin_mul_overflow(data, d, &data);
    }
    if (overflow) fail(path, "header declares more than 2^64 bytes of data");
    const uint64_t total = 4 + 4 * uint64_t{bytes[3]} + data;
    return parse_header(path, bytes, available, total);  // checks magic, type and dimensions
  }
  return parse_header(path, bytes, available, available);  // fails with the precise reason
}

// The first `max_rows` rows of a header's data (all when 0 or more than there are): dims and bytes.
Header first_rows(Header h, int64_t max_rows) {
  if (max_rows <= 0 || max_rows >= h.dims[0]) return h;
  h.data_bytes = h.data_bytes / static_cast<uint64_t>(h.dims[0]) * static_cast<uint64_t>(max_rows);
  h.dims[0] = max_rows;
  return h;
}

torch::Tensor read_plain(const std::string& path, int64_t max_rows) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) fail(path, std::string("cannot open: ") + std::strerror(errno));
  std::error_code ec;
  const auto total = std::filesystem::file_size(path, ec);
  if (ec) fail(path, "cannot determine the file size: " + ec.message());

  uint8_t head[kMaxHeader];
  const size_t got = std::fread(head, 1, sizeof(head), f.get());
  const Header h = first_rows(parse_header(path, head, got, total), max_rows);

  auto out = torch::empty(h.dims, torch::kUInt8);
  if (std::fseek(f.get(), static_cast<long>(h.size), SEEK_SET) != 0 ||
      std::fread(out.data_ptr<uint8_t>(), 1, h.data_bytes, f.get()) != h.data_bytes)
    fail(path, "read error: the file changed or could not be read while loading");
  return out;
}

torch::Tensor read_gz(const std::string& path, int64_t max_rows) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> f(gzopen(path.c_str(), "rb"), &gzclose_r);
  if (!f) fail(path, std::string("cannot open: ") + std::strerror(errno ? errno : ENOMEM));
  auto read_some = [&](uint8_t* into, unsigned n) {
    const int got = gzread(f.get(), into, n);
    if (got < 0) {
      int err = 0;
      fail(path, std::string("corrupt gzip data: ") + gzerror(f.get(), &err));
    }
    return static_cast<size_t>(got);
  };
  // The header first: it says how many bytes the data must inflate to, so memory is bounded by
  // that (checked against kMaxGzBytes) and a gzip bomb stops one byte past its declared size.
  uint8_t head[kMaxHeader];
  size_t have = 0;
  while (have < kMaxHeader) {
    const size_t got = read_some(head + have, static_cast<unsigned>(kMaxHeader - have));
    if (got == 0) break;
    have += got;
  }
  Header declared;
  const uint64_t declared_total = [&] {
    Header probe;
    try {
      probe = parse_header_dims_only(path, head, have);
    } catch (const IdxError&) {
      // A damaged deflate stream inflates to garbage before zlib notices: if the rest of the stream
      // (drained into a small buffer, never stored) is corrupt, that is the error to report.
      uint8_t sink[1 << 16];
      size_t drained = 0;
      for (size_t got; drained < kMaxGzBytes && (got = read_some(sink, sizeof sink)) > 0;) drained += got;
      int err = Z_OK;
      const char* msg = gzerror(f.get(), &err);
      if (err != Z_OK) fail(path, std::string("corrupt gzip data: ") + msg);
      throw;
    }
    declared = probe;
    if (first_rows(probe, max_rows).data_bytes > kMaxGzBytes)
      fail(path, fmt::format("declares {} bytes of data, more than the {} this reader accepts from a .gz",
                             probe.data_bytes, kMaxGzBytes));
    return probe.size + probe.data_bytes;
  }();
  if (const Header part = first_rows(declared, max_rows); part.data_bytes < declared.data_bytes) {
    // Only the first rows: inflate exactly them (the rest of the stream is not read, so not checked).
    std::vector<uint8_t> bytes(head, head + have);
    bytes.resize(part.size + part.data_bytes);
    size_t filled = std::min(have, bytes.size());
    while (filled < bytes.size()) {
      const size_t got = read_some(bytes.data() + filled,
                                   static_cast<unsigned>(std::min<size_t>(bytes.size() - filled, size_t{1} << 30)));
      if (got == 0) fail(path, fmt::format("truncated: the stream ends within the first {} rows", part.dims[0]));
      filled += got;
    }
    auto out = torch::empty(part.dims, torch::kUInt8);
    std::memcpy(out.data_ptr<uint8_t>(), bytes.data() + part.size, part.data_bytes);
    return out;
  }
  std::vector<uint8_t> bytes(head, head + have);
  bytes.resize(declared_total + 1);  // one spare byte detects trailing data
  size_t filled = have;
  while (filled < bytes.size()) {
    const size_t want = std::min<size_t>(bytes.size() - filled, size_t{1} << 30);
    const size_t got = read_some(bytes.data() + filled, static_cast<unsigned>(want));
    if (got == 0) break;
    filled += got;
  }
  if (filled > declared_total) {
    uint8_t sink[4096];
    size_t extra = filled - declared_total;
    for (size_t got; extra < (size_t{1} << 20) && (got = read_some(sink, sizeof sink)) > 0;) extra += got;
    fail(path, fmt::format("{}{} unexpected trailing bytes after the data (header declares {} bytes with itself)",
                           extra >= (size_t{1} << 20) ? "at least " : "", extra, declared_total));
  }
  bytes.resize(filled);
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

torch::Tensor read_idx(const std::string& path, int64_t max_rows) {
  // fopen/gzopen succeed on a directory on Linux (the failure would only surface as a read error); a
  // FIFO, socket or device would block or never end.
  if (const auto why = unreadable_reason(path); !why.empty()) fail(path, "cannot open: " + why);
  return is_gz(path) ? read_gz(path, max_rows) : read_plain(path, max_rows);
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
