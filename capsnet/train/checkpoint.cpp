#include "capsnet/train/checkpoint.h"
#include "capsnet/train/json_input.h"

#include "capsnet/data/files.h"
#include "capsnet/data/mnist.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>

#include <zlib.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "capsnet/train/export.h"
#include "capsnet/train/parse_config.h"
#include "capsnet/train/zip_bounds.h"

namespace capsnet::train {
namespace {

constexpr const char* kFormat = "capsnet-checkpoint";
// 3: one archive streamed to the file, followed by a trailer with its size and CRC-32;
// 2: a CRC-checked payload archive inside an outer one; 1: no checksum. All three load.
constexpr int64_t kVersion = 3;

// Version 3's trailer, the file's last 20 bytes: magic, the archive's size (8 bytes) and CRC-32 (4 bytes),
// little-endian. LibTorch's zip reader checks no record's CRC, so this is the file's only checksum.
constexpr char kTrailerMagic[8] = {'c', 'a', 'p', 's', 'c', 'k', 'p', '3'};
constexpr size_t kTrailerSize = 20;

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

uLong crc32_update(uLong crc, const void* data, size_t n) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib's length is a uInt: feed at most 1 GiB at a time
    const auto chunk = static_cast<uInt>(std::min<size_t>(n, size_t{1} << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return crc;
}

int64_t crc32_of(const void* data, size_t n) {
  return static_cast<int64_t>(crc32_update(::crc32(0L, Z_NULL, 0), data, n));
}

void check_readable(const std::string& path) {
  if (!std::filesystem::exists(path)) throw CheckpointError(fmt::format("checkpoint {}: no such file", path));
  if (const auto why = data::unreadable_reason(path); !why.empty())
    throw CheckpointError(fmt::format("checkpoint {}: cannot open: {}", path, why));
}

// An open file, closed when it goes out of scope.
struct OpenFile {
  int fd;
  explicit OpenFile(const std::string& path) : fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {}
  ~OpenFile() {
    if (fd >= 0) ::close(fd);
  }
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  /// Up to n bytes at offset into out (fewer only at the end of the file or on an error): how many.
  size_t read_at(uint64_t offset, size_t n, char* out) const {
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    return done;
  }
};

// Whether the open `file` of `file_size` bytes ends in a version-3 trailer's magic; the trailer in `trailer`.
bool read_trailer(const OpenFile& file, uint64_t file_size, char (&trailer)[kTrailerSize]) {
  return file_size >= kTrailerSize && file.read_at(file_size - kTrailerSize, kTrailerSize, trailer) == kTrailerSize &&
         std::memcmp(trailer, kTrailerMagic, sizeof kTrailerMagic) == 0;
}

// The size of a version-3 file's archive (the file less its trailer), after checking the trailer and the
// CRC-32 over the archive, read through `file` a few MB at a time; nullopt when the file has no trailer
// (an earlier version, or not a checkpoint). No copy of the archive is held: LibTorch then parses it from
// the same open file (open_checked), so the bytes parsed are the bytes checked even if another writer
// renames a new checkpoint over the path meanwhile.
std::optional<uint64_t> checked_archive_size(const std::string& path, const OpenFile& file) {
  struct stat st {};
  if (::fstat(file.fd, &st) != 0)
    throw CheckpointError(fmt::format("checkpoint {}: cannot open: {}", path, std::strerror(errno)));
  const auto file_size = static_cast<uint64_t>(st.st_size);
  char trailer[kTrailerSize];
  if (!read_trailer(file, file_size, trailer)) return std::nullopt;
  const uint64_t size = little_endian(trailer + 8, 8), crc = little_endian(trailer + 16, 4);
  if (size != file_size - kTrailerSize)
    throw CheckpointError(fmt::format("checkpoint {}: corrupt or truncated (its trailer says {} bytes of archive, the "
                                      "file holds {})",
                                      path, size, file_size - kTrailerSize));
  std::vector<char> chunk(size_t{4} << 20);
  uLong sum = ::crc32(0L, Z_NULL, 0);
  for (uint64_t at = 0; at < size;) {
    const auto want = static_cast<size_t>(std::min<uint64_t>(chunk.size(), size - at));
    errno = 0;
    if (file.read_at(at, want, chunk.data()) != want)
      throw CheckpointError(fmt::format("checkpoint {}: read failed at byte {} of {}: {}", path, at, size,
                                        errno ? std::strerror(errno) : "the file became shorter while it was read"));
    sum = crc32_update(sum, chunk.data(), want);
    at += want;
  }
  if (static_cast<uint64_t>(sum) != crc)
    throw CheckpointError(fmt::format("checkpoint {}: corrupt (checksum mismatch: the file was damaged after it was "
                                      "written)",
                                      path));
  return size;
}

// Runs `load` (LibTorch reading an archive) unless `expansion_problem` (zip_bounds.h's answer for that
// archive) says it is a zip bomb. `subject` ("" or "its payload: ") starts the messages' second part.
// LibTorch copies every record out while it loads, so an archive in memory may be freed afterwards.
template <class Load>
void load_archive(const std::string& path, const std::string& expansion_problem, Load&& load, const char* subject = "") {
  if (!expansion_problem.empty())
    throw CheckpointError(
        fmt::format("checkpoint {}: {}corrupt or hostile: {}; refused before reading", path, subject, expansion_problem));
  try {
    load();
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: {}cannot be read (corrupt or truncated?): {}", path, subject,
                                      std::string(e.what()).substr(0, 200)));
  }
}

// The meta JSON an archive holds under "meta" (the outer one, or the copy inside a version-2 payload).
nlohmann::json read_meta_json(const std::string& path, torch::serialize::InputArchive& archive) {
  c10::IValue value;
  if (!archive.try_read("meta", value) || !value.isString())
    throw CheckpointError(fmt::format("checkpoint {}: no capsnet metadata (not a capsnet checkpoint?)", path));
  auto j = parse_json_or_discarded(value.toStringRef());
  if (j.is_discarded() || !j.is_object())
    throw CheckpointError(fmt::format(
        "checkpoint {}: corrupt (its metadata is not a JSON object of at most {} levels)", path, kMaxJsonDepth));
  return j;
}

// Version 2: the model, optimizer and generator live in a payload archive whose CRC-32 is in the
// meta. Any flipped byte in it is reported as corruption instead of loading different weights.
void open_payload(const std::string& path, torch::serialize::InputArchive& outer, int64_t payload_crc32,
                  int64_t payload_bytes, torch::serialize::InputArchive& payload) {
  torch::Tensor bytes;
  try {
    if (!outer.try_read("payload", bytes)) throw CheckpointError(fmt::format("checkpoint {}: corrupt (no payload)", path));
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: corrupt (payload unreadable)", path));
  }
  if (bytes.scalar_type() != torch::kUInt8 || bytes.dim() != 1 || bytes.numel() != payload_bytes)
    throw CheckpointError(fmt::format("checkpoint {}: corrupt (payload has the wrong size)", path));
  bytes = bytes.contiguous();
  if (crc32_of(bytes.data_ptr(), static_cast<size_t>(bytes.numel())) != payload_crc32)
    throw CheckpointError(fmt::format("checkpoint {}: corrupt (checksum mismatch: the file was damaged after it was "
                                      "written)",
                                      path));
  const auto* data = static_cast<const char*>(bytes.data_ptr());
  const auto n = static_cast<size_t>(bytes.numel());
  load_archive(path, zip_expansion_problem(data, n), [&] { payload.load_from(data, n); }, "its payload: ");
}

// A checkpoint opened and checked: its meta, and the archive holding model, optimizer and generator
// (the file's one archive for versions 1 and 3, the CRC-checked payload for version 2). Every reader goes
// through here, so nothing outside a checksum is ever trusted: version 3's covers every byte of its archive;
// a version-2 file's outer meta (step, model config, training options) is used only when it equals the copy
// inside the payload, byte for byte after parsing. A version-1 file (no checksum) is read as it is.
struct CheckedCheckpoint {
  CheckpointMeta meta;
  int64_t version = 1;
  torch::serialize::InputArchive outer, payload;
  torch::serialize::InputArchive& contents() { return version == 2 ? payload : outer; }
};

CheckedCheckpoint open_checked(const std::string& path) {
  CheckedCheckpoint c;
  check_readable(path);
  bool trailer = false;
  OpenFile file(path);
  if (file.fd < 0) throw CheckpointError(fmt::format("checkpoint {}: cannot open: {}", path, std::strerror(errno)));
  if (const auto size = checked_archive_size(path, file)) {
    trailer = true;
    // The archive is the file less its trailer: up to n of its bytes at offset, read through `file` (LibTorch
    // reads it so, record by record; the zip bound wants all n).
    const auto read_archive = [&](uint64_t offset, void* out, size_t n) -> size_t {
      if (offset >= *size) return 0;
      return file.read_at(offset, static_cast<size_t>(std::min<uint64_t>(n, *size - offset)), static_cast<char*>(out));
    };
    const auto read_all = [&](uint64_t offset, size_t n, char* out) { return read_archive(offset, out, n) == n; };
    load_archive(path, zip_expansion_problem(read_all, *size), [&] {
      c.outer.load_from(read_archive, [&]() -> size_t { return static_cast<size_t>(*size); });
    });
  } else {  // read lazily by LibTorch's file reader: never loaded whole
    load_archive(path, zip_file_expansion_problem(path), [&] { c.outer.load_from(path); });
  }
  auto j = read_meta_json(path, c.outer);
  if (j.value("format", nlohmann::json()) != kFormat)
    throw CheckpointError(fmt::format("checkpoint {}: not a capsnet checkpoint (or corrupt: format {})", path,
                                      j.value("format", nlohmann::json()).dump()));
  const auto version = j.value("version", nlohmann::json());
  if (version != 1 && version != 2 && version != kVersion)
    throw CheckpointError(fmt::format("checkpoint {}: unsupported version {} (or corrupt)", path, version.dump()));
  c.version = version.get<int64_t>();
  // Only version 3 has the trailer, and it always has one: a damaged magic must not skip the check.
  if ((c.version == 3) != trailer)
    throw CheckpointError(fmt::format("checkpoint {}: corrupt (version {} {} a checksum trailer)", path, c.version,
                                      trailer ? "with" : "without"));
  if (c.version == 2) {
    const auto crc = j.value("payload_crc32", nlohmann::json()), size = j.value("payload_bytes", nlohmann::json());
    if (!crc.is_number_integer() || !size.is_number_integer())
      throw CheckpointError(fmt::format("checkpoint {}: corrupt (no payload checksum in its metadata)", path));
    open_payload(path, c.outer, crc.get<int64_t>(), size.get<int64_t>(), c.payload);
    // The payload holds the meta as it was written (without the checksum fields): the outer copy
    // must say exactly the same, else a flipped byte there would load another model silently.
    auto outer_meta = j;
    outer_meta.erase("payload_crc32");
    outer_meta.erase("payload_bytes");
    if (read_meta_json(path, c.payload) != outer_meta)
      throw CheckpointError(fmt::format("checkpoint {}: corrupt (its metadata differs from the checksummed copy: the "
                                        "file was damaged after it was written)",
                                        path));
  }
  try {
    c.meta.step = j.at("step").get<int64_t>();
    c.meta.model_config = j.at("model");
    c.meta.train_options = j.value("train", nlohmann::json::object());
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: malformed metadata: {}", path, e.what()));
  }
  if (c.meta.step < 0)
    throw CheckpointError(fmt::format("checkpoint {}: negative step {} (a step count is never negative)", path,
                                      c.meta.step));
  if (!c.meta.model_config.is_object())
    throw CheckpointError(fmt::format("checkpoint {}: malformed metadata: its model config is not an object", path));
  return c;
}

// Temp files of writers that died (kill -9, power loss) before their rename: "<name>.tmp.<pid>"
// whose process is gone. Removed before each save so they never pile up.
void remove_orphaned_temps(const std::filesystem::path& path) {
  const auto dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const std::string prefix = path.filename().string() + ".tmp.";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const auto pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid == ::getpid() || (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH)) continue;
    std::filesystem::remove(e.path(), ec);
  }
}

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(const ByteSink&)>& produce) {
  // Renaming over a device node or FIFO would replace it with a regular file.
  if (data::exists_but_not_regular(path))
    throw std::runtime_error(fmt::format("{}: not a regular file (a directory, device, FIFO or socket): refusing to "
                                         "replace it",
                                         path));
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create directory {}: {}", parent.string(), ec.message()));
  remove_orphaned_temps(path);
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot create {}: {}", tmp, std::strerror(errno)));
  // The sink never fails towards the producer (LibTorch's zip writer must not see a short write: it
  // throws from its destructor, std::terminate): the first error is kept and later bytes only counted.
  size_t done = 0, offered = 0;
  int error = 0;
  const ByteSink sink = [&](const void* data, size_t n) {
    offered += n;
    const auto* p = static_cast<const char*>(data);
    for (size_t left = n; left > 0 && !error;) {
      const ssize_t w = ::write(fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        error = w < 0 ? errno : ENOSPC;
        break;
      }
      done += static_cast<size_t>(w);
      p += w;
      left -= static_cast<size_t>(w);
    }
  };
  try {
    produce(sink);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (!error && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && !error) error = errno;
  if (error) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(fmt::format("write failed after {} of {} bytes: {} (the previous file, if any, is "
                                         "unchanged)",
                                         done, offered, std::strerror(error)));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    throw std::runtime_error(fmt::format("rename failed: {}", ec.message()));
  }
  fsync_path(parent.empty() ? "." : parent.string());
}

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  write_file_atomically(path, [&](const ByteSink& write) { write(bytes.data(), bytes.size()); });
}

void save_checkpoint(const std::string& path, models::CapsNet& model, torch::optim::Optimizer* optimizer,
                     const CheckpointMeta& meta) {
  save_checkpoint(path, *model, optimizer, meta);
}

void save_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                     const CheckpointMeta& meta, const NamedTensors& weight_average) {
  nlohmann::json j = {{"format", kFormat},
                      {"version", kVersion},
                      {"step", meta.step},
                      {"model", meta.model_config},
                      {"train", meta.train_options}};
  // One archive, streamed to the temp file with its CRC-32 computed on the way and written after it: no
  // copy of the tensors' bytes is made (a buffer of the serialised archive was 99 MB for the CapsNet with
  // Adam's moments, the peak of a training command). LibTorch's zip writer throws from its destructor when
  // a write falls short (std::terminate), so write_file_atomically's sink never reports one to it.
  torch::serialize::OutputArchive archive;
  archive.write("meta", c10::IValue(dump_json(j)));
  torch::serialize::OutputArchive model_archive;
  model.save(model_archive);
  archive.write("model", model_archive);
  if (optimizer) {
    torch::serialize::OutputArchive optimizer_archive;
    optimizer->save(optimizer_archive);
    archive.write("optimizer", optimizer_archive);
  }
  if (!weight_average.empty()) {
    torch::serialize::OutputArchive average_archive;
    for (const auto& [name, t] : weight_average) average_archive.write(name, t);
    archive.write("weight_average", average_archive);
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng_cpu", gen.get_state());
  }
  try {
    write_file_atomically(path, [&](const ByteSink& write) {
      uLong crc = ::crc32(0L, Z_NULL, 0);
      uint64_t size = 0;
      archive.save_to([&](const void* data, size_t n) -> size_t {
        crc = crc32_update(crc, data, n);
        size += n;
        write(data, n);
        return n;
      });
      char trailer[kTrailerSize];
      std::memcpy(trailer, kTrailerMagic, sizeof kTrailerMagic);
      for (int i = 0; i < 8; ++i) trailer[8 + i] = static_cast<char>((size >> (8 * i)) & 0xFF);
      for (int i = 0; i < 4; ++i) trailer[16 + i] = static_cast<char>((crc >> (8 * i)) & 0xFF);
      write(trailer, kTrailerSize);
    });
  } catch (const std::runtime_error& e) {
    throw CheckpointError(fmt::format("checkpoint {}: {}", path, e.what()));
  }
}

CheckpointMeta read_checkpoint_meta(const std::string& path) { return open_checked(path).meta; }

bool has_checkpoint_trailer(const std::string& path) {
  // Only a regular file is opened: opening a FIFO would wait for a writer (its readers refuse it).
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  OpenFile file(path);
  if (file.fd < 0 || ::fstat(file.fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  char trailer[kTrailerSize];
  return read_trailer(file, static_cast<uint64_t>(st.st_size), trailer);
}

CheckpointMeta load_checkpoint(const std::string& path, models::CapsNet& model, torch::optim::Optimizer* optimizer) {
  const auto config = model->config;
  return load_checkpoint(path, *model, optimizer,
                         [&](const nlohmann::json& saved) { return models::same_config(saved, config); });
}

namespace {

// load_checkpoint's work on a checkpoint already opened (and checked) by open_checked.
CheckpointMeta load_opened(CheckedCheckpoint& checked, const std::string& path, torch::nn::Module& model,
                           torch::optim::Optimizer* optimizer,
                           const std::function<bool(const nlohmann::json&)>& config_matches,
                           NamedTensors* weight_average = nullptr, bool* average_found = nullptr) {
  const auto& meta = checked.meta;
  auto& archive = checked.contents();
  if (!config_matches(meta.model_config))
    throw CheckpointError(fmt::format("checkpoint {}: its model config {} does not match the model being loaded",
                                      path, dump_json(meta.model_config)));
  // LibTorch's loader adopts whatever shape a stored tensor has: a file whose tensors do not fit its
  // own config (crafted, or a config edited after the fact) would fail later, deep inside indexing.
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& p : model.named_parameters()) shapes.emplace_back(p.key(), p.value().sizes().vec());
  for (const auto& b : model.named_buffers()) shapes.emplace_back(b.key(), b.value().sizes().vec());
  try {
    torch::serialize::InputArchive model_archive;
    archive.read("model", model_archive);
    model.load(model_archive);
    const auto params = model.named_parameters(), buffers = model.named_buffers();
    for (const auto& [name, expected] : shapes) {
      const auto* t = params.find(name) ? params.find(name) : buffers.find(name);
      if (t && t->sizes().vec() != expected)
        throw CheckpointError(fmt::format("checkpoint {}: tensor {} has shape {} in the file, but its model config "
                                          "builds {}",
                                          path, name, c10::str(t->sizes()), c10::str(c10::IntArrayRef(expected))));
    }
    if (optimizer) {
      torch::serialize::InputArchive optimizer_archive;
      if (!archive.try_read("optimizer", optimizer_archive))
        throw CheckpointError(fmt::format("checkpoint {}: has no optimizer state (cannot resume)", path));
      optimizer->load(optimizer_archive);
    }
    if (average_found) *average_found = false;
    torch::serialize::InputArchive average_archive;
    if (weight_average && archive.try_read("weight_average", average_archive)) {
      // Read all first, so that a misfit leaves the caller's tensors unchanged.
      std::vector<torch::Tensor> stored;
      for (const auto& [name, t] : *weight_average) {
        torch::Tensor s;
        if (!average_archive.try_read(name, s) || s.sizes() != t.sizes())
          throw CheckpointError(
              fmt::format("checkpoint {}: its weight average does not fit the model (tensor {})", path, name));
        stored.push_back(s);
      }
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < stored.size(); ++i) (*weight_average)[i].second.copy_(stored[i]);
      if (average_found) *average_found = true;
    }
    torch::Tensor rng;
    if (archive.try_read("rng_cpu", rng)) {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng);
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: incompatible or damaged contents: {}", path,
                                      std::string(e.what()).substr(0, 300)));
  }
  return meta;
}

}  // namespace

CheckpointMeta load_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                               const std::function<bool(const nlohmann::json&)>& config_matches,
                               NamedTensors* weight_average, bool* average_found) {
  auto checked = open_checked(path);
  return load_opened(checked, path, model, optimizer, config_matches, weight_average, average_found);
}

namespace {

/// The input spec of a file whose training options or model card is `info` and model config `config`.
InputSpec input_spec_of(nlohmann::json info, const nlohmann::json& config, const std::string& path) {
  if (!info.is_object()) info = nlohmann::json::object();
  InputSpec spec;
  try {
    spec.dataset = info.value("dataset", std::string());
    spec.image_fit = info.value("image_fit", spec.image_fit);
    spec.test_fraction = info.value("test_fraction", spec.test_fraction);
    spec.split_seed = info.value("split_seed", spec.split_seed);
    if (info.contains("classes")) spec.class_names = info["classes"].get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: malformed classes / image_fit / dataset: {}", path, e.what()));
  }
  const int64_t K = config.is_object() ? config.value("num_classes", int64_t{10}) : 10;
  if (spec.class_names.empty() && (spec.dataset == "mnist" || spec.dataset == "fashion-mnist") && K == 10)
    spec.class_names = data::class_names(spec.dataset);
  if (static_cast<int64_t>(spec.class_names.size()) != K) {
    spec.class_names.clear();
    for (int64_t k = 0; k < K; ++k) spec.class_names.push_back(std::to_string(k));
  }
  return spec;
}

}  // namespace

InputSpec read_input_spec(const std::string& path) {
  if (auto weights = try_read_weights(path)) return input_spec_of(weights->card, weights->config, path);
  const auto meta = read_checkpoint_meta(path);
  return input_spec_of(meta.train_options, meta.model_config, path);
}

std::string checkpoint_model(const CheckpointMeta& meta) {
  // `capsnet em` writes "task": "em" into its options; the baseline CNN (capsnet affine / stn) is the one
  // model whose config has fully connected hidden layers.
  const bool em = meta.train_options.is_object() && meta.train_options.value("task", std::string()) == "em";
  if (em) return kMatrixCapsNetModel;
  if (meta.model_config.is_object() && meta.model_config.contains("fc1_units")) return kBaselineCnnModel;
  return kCapsNetModel;
}

std::string stored_model(const std::string& path) {
  if (auto weights = try_read_weights(path)) return weights->model;
  return checkpoint_model(read_checkpoint_meta(path));
}

namespace {

// The checkpoint `path`, opened and checked, when it holds the `wanted` network; CheckpointError saying what
// it holds otherwise.
CheckedCheckpoint open_of_kind(const std::string& path, const char* wanted) {
  auto checked = open_checked(path);
  if (const auto kind = checkpoint_model(checked.meta); kind != wanted)
    throw CheckpointError(fmt::format("checkpoint {}: holds {}, not {}; eval, export and predict take it, this "
                                      "command does not",
                                      path, describe_model_kind(kind), describe_model_kind(wanted)));
  return checked;
}

// The network of the checkpoint `path`, opened as `checked` (read once), weights loaded, eval mode. The
// stored config is compared through from_json, as a resume compares it (for EM: a config without the newer
// routing keys means the earlier routing).
template <class Model, class Config>
Model network_from_checkpoint(const std::string& path, CheckedCheckpoint&& checked) {
  const auto config =
      parse_config<Config, CheckpointError>(checked.meta.model_config, fmt::format("checkpoint {}", path));
  Model model(config);
  load_opened(checked, path, *model, nullptr,
              [&](const nlohmann::json& saved) { return Config::from_json(saved).to_json() == config.to_json(); });
  model->eval();
  return model;
}

}  // namespace

// A shipped / exported weight file (weights and config only) serves wherever a model is needed.
models::CapsNet load_model(const std::string& path) {
  if (auto weights = try_read_weights(path)) return model_from_weights(*weights, path);
  return network_from_checkpoint<models::CapsNet, models::CapsNetConfig>(path, open_of_kind(path, kCapsNetModel));
}

models::MatrixCapsNet load_matrix_model(const std::string& path) {
  if (auto weights = try_read_weights(path)) return matrix_model_from_weights(*weights, path);
  return network_from_checkpoint<models::MatrixCapsNet, models::MatrixCapsNetConfig>(
      path, open_of_kind(path, kMatrixCapsNetModel));
}

models::BaselineCnn load_baseline_cnn(const std::string& path) {
  if (auto weights = try_read_weights(path)) return baseline_cnn_from_weights(*weights, path);
  return network_from_checkpoint<models::BaselineCnn, models::BaselineCnnConfig>(path,
                                                                                 open_of_kind(path, kBaselineCnnModel));
}

int64_t LoadedModel::image_size() const {
  return std::visit([](const auto& net) { return net->config.image_size; }, network);
}

int64_t LoadedModel::image_channels() const {
  return std::visit([](const auto& net) { return net->config.image_channels; }, network);
}

void LoadedModel::set_precision(Precision precision) {
  std::visit([precision](auto& net) { net->set_precision(precision); }, network);
}

LoadedModel load_any_model(const std::string& path) {
  if (auto w = try_read_weights(path)) {
    LoadedModel m{w->model, models::CapsNet{nullptr}, input_spec_of(w->card, w->config, path), w->step,
                  w->card.is_object() ? w->card.value("train_options", nlohmann::json()) : nlohmann::json(), true};
    if (w->model == kMatrixCapsNetModel)
      m.network = matrix_model_from_weights(*w, path);
    else if (w->model == kBaselineCnnModel)
      m.network = baseline_cnn_from_weights(*w, path);
    else
      m.network = model_from_weights(*w, path);
    return m;
  }
  // A checkpoint: opened and checked once, for its meta and its weights.
  auto checked = open_checked(path);
  LoadedModel m{checkpoint_model(checked.meta), models::CapsNet{nullptr},
                input_spec_of(checked.meta.train_options, checked.meta.model_config, path), checked.meta.step,
                checked.meta.train_options, false};
  if (m.kind == kMatrixCapsNetModel)
    m.network = network_from_checkpoint<models::MatrixCapsNet, models::MatrixCapsNetConfig>(path, std::move(checked));
  else if (m.kind == kBaselineCnnModel)
    m.network = network_from_checkpoint<models::BaselineCnn, models::BaselineCnnConfig>(path, std::move(checked));
  else
    m.network = network_from_checkpoint<models::CapsNet, models::CapsNetConfig>(path, std::move(checked));
  return m;
}

}  // namespace capsnet::train
