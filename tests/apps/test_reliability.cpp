// Regression tests of the hostile-input campaign (docs/reliability.md): every case generates its own
// bad input. Data loss (run folders, outputs over inputs, full disks, flipped bytes), crashes
// (nested JSON in the report, flag values at their limits, LibTorch errors) and their messages.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <zlib.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>

#include "capsnet/data/idx.h"
#include "capsnet/data/mnist.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/evaluate.h"
#include "capsnet/train/export.h"
#include "capsnet/train/json_input.h"
#include "capsnet/train/metrics.h"
#include "capsnet/train/trainer.h"
#include "capsnet/train/zip_bounds.h"
#include "apps/report.h"
#include "cli_helpers.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

namespace fs = std::filesystem;
using testing::read_bytes;
using testing::run_command;
using testing::TempDir;
using testing::tiny_config;
using testing::write_bytes;

const std::string kCli = CAPSNET_CLI;

void expect_contains(const std::string& text, const std::string& phrase) {
  EXPECT_NE(text.find(phrase), std::string::npos) << "expected \"" << phrase << "\" in:\n" << text;
}

/// A tiny model's checkpoint in `path`.
void tiny_checkpoint(const std::string& path, uint64_t seed = 1) {
  torch::manual_seed(seed);
  models::CapsNet model(tiny_config());
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  train::save_checkpoint(path, model, &adam, {7, model->config.to_json(), nlohmann::json::object()});
}

/// Loading the checkpoint `path` with `load` (default: into a tiny_config() CapsNet) fails with a CheckpointError
/// that says "corrupt" and names the file; `what` names the damage in the failure message.
void expect_corrupt_checkpoint(const std::string& path, const std::string& what,
                               const std::function<void()>& load = {}) {
  try {
    if (load) {
      load();
    } else {
      models::CapsNet model(tiny_config());
      train::load_checkpoint(path, model, nullptr);
    }
    ADD_FAILURE() << what << " loaded";
  } catch (const train::CheckpointError& e) {
    expect_contains(e.what(), "corrupt");
    expect_contains(e.what(), path);
  }
}

// --- archives that inflate beyond their size ---------------------------------------------------------

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

/// A one-entry zip archive whose entry `name` holds `inflated` zero bytes deflated (method 8): a few KB that
/// declare megabytes. With `declare_zip64` > 0 the entry declares that many bytes instead, through the zip64
/// extra field (its data stays the deflated zeros).
std::string zip_of_zeros(const std::string& name, uint64_t inflated, uint64_t declare_zip64 = 0) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 9, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::vector<unsigned char> zeros(1 << 20, 0), out(1 << 20);
  std::string data;
  uLong crc = crc32(0L, Z_NULL, 0);
  for (uint64_t left = inflated;;) {
    const auto n = static_cast<uInt>(std::min<uint64_t>(left, zeros.size()));
    crc = crc32(crc, zeros.data(), n);
    left -= n;
    z.next_in = zeros.data();
    z.avail_in = n;
    int rc;
    do {
      z.next_out = out.data();
      z.avail_out = static_cast<uInt>(out.size());
      rc = deflate(&z, left == 0 ? Z_FINISH : Z_NO_FLUSH);
      data.append(reinterpret_cast<char*>(out.data()), out.size() - z.avail_out);
    } while (z.avail_out == 0 || (left == 0 && rc != Z_STREAM_END));
    if (left == 0) break;
  }
  deflateEnd(&z);
  const uint64_t size32 = declare_zip64 > 0 ? 0xFFFFFFFFu : inflated;
  std::string extra;
  if (declare_zip64 > 0) {
    put_le(extra, 0x0001, 2);
    put_le(extra, 8, 2);
    put_le(extra, declare_zip64, 8);
  }
  std::string zip;
  put_le(zip, 0x04034b50, 4);
  for (uint64_t v : {20, 0, 8, 0, 0}) put_le(zip, v, 2);
  put_le(zip, crc, 4);
  put_le(zip, data.size(), 4);
  put_le(zip, size32, 4);
  put_le(zip, name.size(), 2);
  put_le(zip, 0, 2);
  zip += name + data;
  const auto directory_at = zip.size();
  put_le(zip, 0x02014b50, 4);
  for (uint64_t v : {20, 20, 0, 8, 0, 0}) put_le(zip, v, 2);
  put_le(zip, crc, 4);
  put_le(zip, data.size(), 4);
  put_le(zip, size32, 4);
  for (uint64_t v : {name.size(), extra.size(), size_t{0}, size_t{0}, size_t{0}}) put_le(zip, v, 2);
  put_le(zip, 0, 4);
  put_le(zip, 0, 4);
  zip += name + extra;
  const auto directory_bytes = zip.size() - directory_at;
  put_le(zip, 0x06054b50, 4);
  for (uint64_t v : {0, 0, 1, 1}) put_le(zip, v, 2);
  put_le(zip, directory_bytes, 4);
  put_le(zip, directory_at, 4);
  put_le(zip, 0, 2);
  return zip;
}

TEST(Reliability, ArchivesThatDeclareMoreThanTheirSizeAreRefusedBeforeInflating) {
  TempDir dir;
  // What LibTorch writes passes: a checkpoint file and a pickled weight dict (records stored).
  const auto good = dir / "good.pt";
  tiny_checkpoint(good);
  EXPECT_EQ(train::zip_file_expansion_problem(good), "");
  const auto pickled = torch::pickle_save(c10::IValue(torch::ones({1000})));
  EXPECT_EQ(train::zip_expansion_problem(pickled.data(), pickled.size()), "");

  // 64 MiB of zeros in ~64 KB: the directory declares 1000x the file.
  const auto bomb = zip_of_zeros("archive/data.pkl", 64u << 20);
  ASSERT_LT(bomb.size(), 1u << 20);
  const auto why = train::zip_expansion_problem(bomb.data(), bomb.size());
  expect_contains(why, "67108864 bytes");
  expect_contains(why, "archive/data.pkl");
  // The same archive with the size in the zip64 extra field (1 TiB declared) is read through it.
  const auto bomb64 = zip_of_zeros("archive/data.pkl", 1000, uint64_t{1} << 40);
  expect_contains(train::zip_expansion_problem(bomb64.data(), bomb64.size()), "1099511627776 bytes");
  // A small archive whose declared size is within its own bytes is not the bound's business.
  const auto small = zip_of_zeros("x", 10);
  EXPECT_EQ(train::zip_expansion_problem(small.data(), small.size()), "");

  // Every reader refuses the bomb with a sentence, as a checkpoint and as a weight file.
  const auto path = dir / "bomb.pt";
  write_bytes(path, bomb);
  EXPECT_EQ(train::zip_file_expansion_problem(path), why);
  try {
    train::read_checkpoint_meta(path);
    FAIL() << "read a zip bomb as a checkpoint";
  } catch (const train::CheckpointError& e) {
    expect_contains(e.what(), "refused before reading");
  }
  try {
    train::read_weights(path);
    FAIL() << "read a zip bomb as weights";
  } catch (const train::ExportError& e) {
    expect_contains(e.what(), "refused before reading");
  }
}

// --- checkpoints -----------------------------------------------------------------------------------

TEST(Reliability, FlippedBytesInACheckpointAreReportedAsCorrupt) {
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  tiny_checkpoint(path);
  const auto good = read_bytes(path);
  // Every flip inside the payload region (the middle 80% of the file) must be caught: the zip
  // reader alone loads such files silently with different weights.
  int caught = 0, tried = 0;
  for (double at : {0.15, 0.3, 0.45, 0.6, 0.75, 0.85}) {
    auto bad = good;
    bad[static_cast<size_t>(at * bad.size())] ^= 0x5A;
    write_bytes(path, bad);
    ++tried;
    models::CapsNet model(tiny_config());
    try {
      train::load_checkpoint(path, model, nullptr);
    } catch (const train::CheckpointError& e) {
      ++caught;
      expect_contains(e.what(), path);
    }
  }
  EXPECT_EQ(caught, tried);
  // The undamaged bytes still load, with the step they were written with.
  write_bytes(path, good);
  models::CapsNet model(tiny_config());
  EXPECT_EQ(train::load_checkpoint(path, model, nullptr).step, 7);
}

// A checkpoint is checksummed a 4 MB chunk at a time and LibTorch then reads its records through the same
// open file: a 28 MB one (a [2048, 1024] layer with Adam's moments) must come back bit for bit, and a flipped
// byte in any chunk, the last one included, must be caught.
TEST(Reliability, ACheckpointOfManyChecksumChunksLoadsExactlyAndIsCheckedThroughout) {
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  torch::manual_seed(3);
  torch::nn::Linear written(2048, 1024);
  torch::optim::Adam adam(written->parameters(), torch::optim::AdamOptions(1e-3));
  written(torch::randn({4, 2048})).square().sum().backward();
  adam.step();  // moments of their own values, not zeros
  const auto config = nlohmann::json{{"layer", "linear 2048 -> 1024"}};
  train::save_checkpoint(path, *written, &adam, {5, config, nlohmann::json::object()});
  const auto good = read_bytes(path);
  ASSERT_GT(good.size(), size_t{24} << 20);  // six checksum chunks and more
  const auto same_config = [&](const nlohmann::json& saved) { return saved == config; };

  torch::manual_seed(4);
  torch::nn::Linear loaded(2048, 1024);
  torch::optim::Adam loaded_adam(loaded->parameters(), torch::optim::AdamOptions(1e-3));
  EXPECT_EQ(train::load_checkpoint(path, *loaded, &loaded_adam, same_config).step, 5);
  EXPECT_TRUE(torch::equal(loaded->weight, written->weight));
  EXPECT_TRUE(torch::equal(loaded->bias, written->bias));
  const auto& state = static_cast<const torch::optim::AdamParamState&>(
      *loaded_adam.state().at(c10::guts::to_string(loaded->weight.unsafeGetTensorImpl())));
  const auto& state_written = static_cast<const torch::optim::AdamParamState&>(
      *adam.state().at(c10::guts::to_string(written->weight.unsafeGetTensorImpl())));
  EXPECT_TRUE(torch::equal(state.exp_avg(), state_written.exp_avg()));
  EXPECT_TRUE(torch::equal(state.exp_avg_sq(), state_written.exp_avg_sq()));

  for (const size_t at : {size_t{1}, (size_t{4} << 20) - 1, size_t{4} << 20, (size_t{13} << 20) + 7,
                          good.size() - 21, good.size() / 2}) {
    auto bad = good;
    bad[at] ^= 0x10;
    write_bytes(path, bad);
    expect_corrupt_checkpoint(path, "a byte flipped at " + std::to_string(at) + " of " + std::to_string(good.size()),
                              [&] {
                                torch::nn::Linear model(2048, 1024);
                                train::load_checkpoint(path, *model, nullptr, same_config);
                              });
  }
}

TEST(Reliability, ACorruptPayloadSaysCorruptAndNamesTheFile) {
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  tiny_checkpoint(path);
  auto bytes = read_bytes(path);
  bytes[bytes.size() / 2] ^= 0x01;
  write_bytes(path, bytes);
  expect_corrupt_checkpoint(path, "a flipped bit");
}

TEST(Reliability, AFullDiskDuringCheckpointSaveIsAnErrorNotACrashAndLeavesNoTempFile) {
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  tiny_checkpoint(path, 1);
  const auto previous = read_bytes(path);
  // RLIMIT_FSIZE makes write() fail with EFBIG past 64 KiB: a full disk for this process only.
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  bool threw = false;
  std::string message;
  try {
    tiny_checkpoint(path, 2);
  } catch (const train::CheckpointError& e) {
    threw = true;
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(threw);
  expect_contains(message, "write failed");
  EXPECT_EQ(read_bytes(path), previous) << "the previous checkpoint must be unchanged";
  for (const auto& e : fs::directory_iterator(dir.str()))
    EXPECT_EQ(e.path().filename().string(), "checkpoint.pt") << "left behind: " << e.path();
}

TEST(Reliability, TempFilesOfDeadWritersAreRemovedByTheNextSave) {
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  // pid 999999999 is above any pid_max: its writer is certainly gone. Our own pid's is kept.
  write_bytes(path + ".tmp.999999999", std::string(1000, 'x'));
  write_bytes(path + ".tmp.notapid", "x");
  tiny_checkpoint(path);
  EXPECT_FALSE(fs::exists(path + ".tmp.999999999"));
  EXPECT_TRUE(fs::exists(path + ".tmp.notapid")) << "only <name>.tmp.<pid> files are ours to remove";
}

TEST(Reliability, AStreamedAtomicWriteGivesTheBytesInOrderOrLeavesThePreviousFile) {
  TempDir dir;
  const auto path = dir / "weights.pt";
  train::write_file_atomically(path, [](const train::ByteSink& write) {
    write("abc", 3);
    write("", 0);
    write("defgh", 5);
  });
  EXPECT_EQ(read_bytes(path), "abcdefgh");
  // A producer that throws part-way: its exception comes out, the file keeps its old bytes, no temp file.
  try {
    train::write_file_atomically(path, [](const train::ByteSink& write) {
      write("xyz", 3);
      throw std::logic_error("producer failed");
    });
    FAIL() << "the producer's exception was swallowed";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "producer failed");
  }
  EXPECT_EQ(read_bytes(path), "abcdefgh");
  for (const auto& e : fs::directory_iterator(dir.str()))
    EXPECT_EQ(e.path().filename().string(), "weights.pt") << "left behind: " << e.path();
}

TEST(Reliability, CraftedConfigsFailWithASentenceNotAnAllocation) {
  auto j = models::CapsNetConfig().to_json();
  j["conv1_channels"] = 1000000000;
  try {
    models::CapsNetConfig::from_json(j);
    FAIL() << "accepted conv1_channels = 1e9";
  } catch (const std::invalid_argument& e) {
    expect_contains(e.what(), "conv1_channels");
  }
  j = models::CapsNetConfig().to_json();
  j["primary_types"] = 60000;
  j["digit_dim"] = 60000;
  EXPECT_THROW(models::CapsNetConfig::from_json(j), std::invalid_argument);  // 1e14 parameters
}

/// [begin, end) of the meta's JSON text in a version-3 checkpoint (the archive stores its records uncompressed).
std::pair<size_t, size_t> meta_span(const std::string& bytes) {
  const size_t begin = bytes.find("{\"format\":\"capsnet-checkpoint\"");
  const size_t end = bytes.find("\"version\":3}", begin);
  if (begin == std::string::npos || end == std::string::npos) return {0, 0};
  return {begin, end + std::string("\"version\":3}").size()};
}

TEST(Reliability, AnyChangedByteInACheckpointsMetadataIsReportedAsCorrupt) {
  // The meta (model config, training options, step) decides which model is built and where a resume
  // starts: one changed digit of it must never load another model, or another step, silently.
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  tiny_checkpoint(path);
  const auto good = read_bytes(path);
  const auto [begin, end] = meta_span(good);
  ASSERT_LT(begin, end) << "the meta was not found in the file";
  const std::string meta = good.substr(begin, end - begin);
  expect_contains(meta, "\"step\":7");
  int tried = 0;
  for (size_t i = begin; i < end; ++i) {
    const char c = good[i];
    // Every digit (config sizes, routing iterations, the step) becomes another digit; every 5th other
    // byte has a bit flipped (key names, punctuation, strings).
    char changed;
    if (c >= '0' && c <= '9') changed = static_cast<char>('0' + (c - '0' + 1) % 10);
    else if ((i - begin) % 5 == 0) changed = static_cast<char>(c ^ 0x20);
    else continue;
    auto bad = good;
    bad[i] = changed;
    write_bytes(path, bad);
    ++tried;
    const auto where = "byte " + std::to_string(i - begin) + " of " + meta;
    // The trailer's CRC-32 covers every byte of the archive: each change is an error that says "corrupt"
    // and names the file, from the meta alone and from a full load.
    try {
      train::read_checkpoint_meta(path);
      ADD_FAILURE() << "read: " << where;
    } catch (const train::CheckpointError& e) {
      expect_contains(e.what(), "corrupt");
      expect_contains(e.what(), path);
    }
    models::CapsNet model(tiny_config());
    EXPECT_THROW(train::load_checkpoint(path, model, nullptr), train::CheckpointError) << where;
  }
  EXPECT_GT(tried, 50);
  write_bytes(path, good);
  EXPECT_EQ(train::read_checkpoint_meta(path).step, 7);
}

TEST(Reliability, ACheckpointsTrailerIsCheckedAndCannotBeLostQuietly) {
  // Version 3 ends in 20 bytes: magic, the archive's size, its CRC-32. Damage to any of them, a lost
  // trailer (a truncated copy) or bytes appended after it is "corrupt", never an unchecked load.
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  tiny_checkpoint(path);
  const auto good = read_bytes(path);
  ASSERT_GT(good.size(), 20u);
  EXPECT_EQ(good.substr(good.size() - 20, 8), "capsckp3");
  const auto expect_corrupt = [&](const std::string& bytes, const std::string& what) {
    write_bytes(path, bytes);
    expect_corrupt_checkpoint(path, what);
  };
  for (size_t i = good.size() - 20; i < good.size(); ++i) {
    auto bad = good;
    bad[i] ^= 0x04;
    expect_corrupt(bad, "trailer byte " + std::to_string(i + 20 - good.size()) + " changed");
  }
  expect_corrupt(good.substr(0, good.size() - 20), "the archive without its trailer");
  expect_corrupt(good + std::string(7, 'x'), "bytes after the trailer");
  write_bytes(path, good);
  models::CapsNet model(tiny_config());
  EXPECT_EQ(train::load_checkpoint(path, model, nullptr).step, 7);
}

/// An archive as checkpoint formats 1 and 2 wrote it: "meta" (`version`, `step`, the model's config, train
/// {"seed": seed}) and "model"; returns the meta.
nlohmann::json old_format_archive(torch::serialize::OutputArchive& archive, models::CapsNet& model, int version,
                                  int64_t step, int seed) {
  nlohmann::json meta = {{"format", "capsnet-checkpoint"},
                         {"version", version},
                         {"step", step},
                         {"model", model->config.to_json()},
                         {"train", {{"seed", seed}}}};
  archive.write("meta", c10::IValue(meta.dump()));
  torch::serialize::OutputArchive model_archive;
  model->save(model_archive);
  archive.write("model", model_archive);
  return meta;
}

/// The checkpoint in `path` loads as the model `written`, with `step`.
void expect_loads_as(const std::string& path, models::CapsNet& written, int64_t step) {
  EXPECT_EQ(train::read_checkpoint_meta(path).step, step);
  auto loaded = train::load_model(path);
  const auto a = written->named_parameters(), b = loaded->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& p : a) EXPECT_TRUE(torch::equal(p.value(), b[p.key()])) << p.key();
}

TEST(Reliability, VersionTwoCheckpointsStillLoadAndAreChecked) {
  // The format before version 3: a payload archive (meta, model, generator) whose CRC-32 and size are in
  // an outer archive's meta beside it. Runs under way resume from such files.
  TempDir dir;
  const auto path = dir / "v2.pt";
  torch::manual_seed(5);
  models::CapsNet written(tiny_config());
  torch::serialize::OutputArchive payload;
  auto meta = old_format_archive(payload, written, 2, 13, 5);
  std::string bytes;
  payload.save_to([&](const void* data, size_t n) -> size_t {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  meta["payload_crc32"] = static_cast<int64_t>(crc32(0L, reinterpret_cast<const Bytef*>(bytes.data()),
                                                     static_cast<uInt>(bytes.size())));
  meta["payload_bytes"] = static_cast<int64_t>(bytes.size());
  torch::serialize::OutputArchive outer;
  outer.write("meta", c10::IValue(meta.dump()));
  outer.write("payload", torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8));
  outer.save_to(path);
  expect_loads_as(path, written, 13);

  // A byte of the payload changed (the middle of the file): its checksum still catches it.
  auto bad = read_bytes(path);
  bad[bad.size() / 2] ^= 0x01;
  write_bytes(path, bad);
  expect_corrupt_checkpoint(path, "a damaged version-2 checkpoint");
}

TEST(Reliability, VersionOneCheckpointsWithoutAChecksumStillLoad) {
  // The format before the checksum: meta, model and generator state in one archive.
  TempDir dir;
  const auto path = dir / "v1.pt";
  torch::manual_seed(3);
  models::CapsNet written(tiny_config());
  torch::serialize::OutputArchive archive;
  old_format_archive(archive, written, 1, 11, 3);
  archive.save_to(path);
  expect_loads_as(path, written, 11);
}

TEST(Reliability, ACheckpointWithANegativeStepIsRefusedWithASentence) {
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  models::CapsNet model(tiny_config());
  train::save_checkpoint(path, model, nullptr, {-1, model->config.to_json(), nlohmann::json::object()});
  for (const auto& load : std::vector<std::function<void()>>{[&] { train::read_checkpoint_meta(path); },
                                                             [&] { train::load_model(path); }}) {
    try {
      load();
      ADD_FAILURE() << "a negative step loaded";
    } catch (const train::CheckpointError& e) {
      expect_contains(e.what(), "negative step -1");
      expect_contains(e.what(), path);
    }
  }
}

TEST(Reliability, TensorsOfAnotherShapeThanTheConfigSaysAreRefusedByName) {
  // A checkpoint whose (consistent, checksummed) config says 2 classes while its tensors hold 10:
  // LibTorch's loader would adopt the stored shapes and fail later inside indexing.
  TempDir dir;
  const auto path = dir / "checkpoint.pt";
  models::CapsNet ten(tiny_config());
  auto two = tiny_config();
  two.num_classes = 2;
  train::save_checkpoint(path, ten, nullptr, {1, two.to_json(), nlohmann::json::object()});
  try {
    train::load_model(path);
    FAIL() << "10-class tensors loaded into a 2-class model";
  } catch (const train::CheckpointError& e) {
    expect_contains(e.what(), path);
    expect_contains(e.what(), "digit_caps");
    expect_contains(e.what(), "model config");
  }
}

// --- weight files ----------------------------------------------------------------------------------

TEST(Reliability, AChangedByteInAWeightFileIsReportedAsCorrupt) {
  TempDir dir;
  const auto path = dir / "weights.pt";
  torch::manual_seed(4);
  models::CapsNet model(tiny_config());
  train::ExportOptions options;
  options.card = {{"classes", {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"}}};
  train::save_weights(path, model, 9, options);
  const auto good = read_bytes(path);
  ASSERT_NO_THROW(train::read_weights(path));
  // Tensor data across the file, the step's neighbourhood, a class name of the card, the checksum's own key.
  std::vector<size_t> at;
  for (double f : {0.15, 0.3, 0.45, 0.6, 0.75, 0.85}) at.push_back(static_cast<size_t>(f * good.size()));
  for (const char* text : {"\"classes\"", "crc32"}) {
    const size_t p = good.find(text);
    ASSERT_NE(p, std::string::npos) << text;
    at.push_back(p + 2);
  }
  for (size_t i : at) {
    auto bad = good;
    bad[i] ^= 0x01;
    write_bytes(path, bad);
    try {
      train::load_model(path);  // tries the file as weights, then as a checkpoint
      ADD_FAILURE() << "a weight file with byte " << i << " of " << good.size() << " changed loaded";
    } catch (const std::exception& e) {
      expect_contains(e.what(), "corrupt");
      expect_contains(e.what(), path);
    }
  }
  // Files without the checksum (written before it, like the shipped model) still load.
  const auto unchecked = dir / "unchecked.pt";
  const auto bytes = torch::pickle_save(c10::IValue(train::export_dict(model, 9, {})));
  write_bytes(unchecked, std::string(bytes.begin(), bytes.end()));
  EXPECT_EQ(train::read_weights(unchecked).step, 9);
  EXPECT_NO_THROW(train::load_model(unchecked));
}

TEST(Reliability, WeightFilesAreWrittenByTheCheckpointWriterAndCleanOrphanedTemps) {
  TempDir dir;
  const auto path = dir / "weights.pt";
  write_bytes(path + ".tmp.999999999", std::string(1000, 'x'));  // a writer killed before its rename
  models::CapsNet model(tiny_config());
  train::save_weights(path, model, 1);
  EXPECT_FALSE(fs::exists(path + ".tmp.999999999"));
  for (const auto& e : fs::directory_iterator(dir.str()))
    EXPECT_EQ(e.path().filename().string(), "weights.pt") << "left behind: " << e.path();
}

// --- training --------------------------------------------------------------------------------------

TEST(Reliability, ADivergenceBeforeTheFirstSaveSaysThePreviousRunsCheckpointIsStillThere) {
  TempDir dir;
  const auto out = dir / "run";
  tiny_checkpoint(out + "/checkpoint.pt");  // a previous run's, replaced on purpose (--overwrite)
  const auto previous = read_bytes(out + "/checkpoint.pt");
  train::TrainOptions o;
  o.model = tiny_config();
  o.loop.out_dir = out;
  o.loop.batch_size = 16;
  o.loop.max_steps = 3;
  o.loop.checkpoint_every = 0;
  o.loop.lr = 1e30;  // the first step overflows every weight: the second loss is not finite
  o.loop.progress = false;
  auto set = testing::synthetic_set(64, 12, 5);
  std::ostringstream log;
  try {
    train::train(o, set, nullptr, log);
    FAIL() << "expected TrainingDiverged";
  } catch (const train::TrainingDiverged& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find("none written"), std::string::npos) << msg;
    expect_contains(msg, "still holds the previous run's");
    expect_contains(msg, out + "/checkpoint.pt");
  }
  EXPECT_EQ(read_bytes(out + "/checkpoint.pt"), previous);
  // Without any checkpoint in the folder, the message says only that this run wrote none.
  fs::remove(out + "/checkpoint.pt");
  try {
    train::train(o, set, nullptr, log);
    FAIL() << "expected TrainingDiverged";
  } catch (const train::TrainingDiverged& e) {
    expect_contains(e.what(), "This run wrote no checkpoint yet.");
  }
}

// --- metrics and the report ------------------------------------------------------------------------

TEST(Reliability, MetricsWritesToAFullDeviceFailLoudly) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  train::JsonLinesWriter w("/dev/full");
  EXPECT_THROW(w.write({{"event", "train"}, {"step", 1}}), std::runtime_error);
}

TEST(Reliability, MetricsRecordsCarryAWallClockStamp) {
  TempDir dir;
  {
    train::JsonLinesWriter w(dir / "m.jsonl");
    w.write({{"event", "x"}});
  }
  std::ifstream in(dir / "m.jsonl");
  std::string line;
  std::getline(in, line);
  auto r = nlohmann::json::parse(line);
  ASSERT_TRUE(r.contains("time"));
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  EXPECT_NEAR(r["time"].get<double>(), now, 60);
}

TEST(Reliability, ReportSurvivesNestedArraysAndMalformedMetricsLines) {
  TempDir dir;
  fs::create_directories(dir / "run");
  // eval --json output (a confusion matrix: arrays in an array) and deeper nesting.
  write_bytes(dir / "run/eval.json", R"({"confusion": [[1, 2], [3, 4]], "deep": [[[1], [2, [3]]], {"a": [[]]}]})");
  write_bytes(dir / "run/metrics.jsonl",
              "{\"event\":\"train\",\"step\":1,\"loss\":0.5,\"accuracy\":0.5}\n"
              "{\"event\":7,\"step\":2}\n"                       // event of the wrong type
              "{\"event\":\"train\",\"step\":\"three\"}\n"        // step of the wrong type
              "{\"event\":\"train\",\"step\":4,\"loss\":\"x\"}\n"  // loss of the wrong type
              "[1,2,3]\n"
              "{\"event\":\"eval\",\"step\":5,\"accuracy\":0.9}\n"
              "{\"event\":\"tr");                                 // cut by a crash
  write_bytes(dir / "run/bench.jsonl", "{\"summary\":\"yes\"}\n{\"summary\":true,\"median\":[1,2],\"ratios\":5}\n");
  const auto summary = apps::write_report(dir.str(), dir / "report.html", "t");
  EXPECT_EQ(summary.runs_with_metrics, 1);
  const auto html = read_bytes(dir / "report.html");
  expect_contains(html, "90.00%");  // the one good eval record
}

TEST(Reliability, ReportRendersJsonAtTheDepthLimitAndSkipsDeeperFiles) {
  // Rendering a value recurses once per level and stops at a fixed depth ("…"), whatever the value.
  const int deep = 100000;
  const auto html = apps::json_table(nlohmann::json::parse(std::string(deep, '[') + std::string(deep, ']')));
  expect_contains(html, "…");
  EXPECT_LT(html.size(), 10000u);
  // Files are read through the one nesting limit (train::kMaxJsonDepth): at the limit they render,
  // one level deeper (and 100,000 levels, which crashed the report before) they are skipped.
  auto arrays = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  auto objects = [](int depth) {
    std::string o;
    for (int i = 0; i < depth; ++i) o += "{\"a\":";
    return o + "1" + std::string(depth, '}');
  };
  TempDir dir;
  fs::create_directories(dir / "run");
  write_bytes(dir / "run/arrays.json", arrays(train::kMaxJsonDepth));
  write_bytes(dir / "run/objects.json", objects(train::kMaxJsonDepth));
  write_bytes(dir / "run/too_deep.json", arrays(train::kMaxJsonDepth + 1));
  write_bytes(dir / "run/far_too_deep.json", objects(deep));
  write_bytes(dir / "run/metrics.jsonl", objects(deep) + "\n{\"event\":\"eval\",\"step\":5,\"accuracy\":0.9}\n");
  const auto summary = apps::write_report(dir.str(), dir / "report.html", "t");
  EXPECT_EQ(summary.tables, 2);  // arrays.json and objects.json
  const auto page = read_bytes(dir / "report.html");
  expect_contains(page, "…");
  expect_contains(page, "90.00%");
}

TEST(Reliability, ReportRefusesJsonNestedAMillionLevelsDeepWithoutCrashing) {
  // Copying or destroying such a value recursed once per level; it is now refused while parsing.
  const int depth = 1000000;
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  TempDir dir;
  fs::create_directories(dir / "run");
  write_bytes(dir / "run/deep.json", deep);
  write_bytes(dir / "run/bench.jsonl", "{\"summary\":true,\"median\":{\"fused\":{\"x\":" + deep + "}}}\n" +
                                           "{\"summary\":true,\"median\":{\"fused\":{\"train\":12.5}}}\n");
  write_bytes(dir / "run/metrics.jsonl", deep + "\n{\"event\":\"eval\",\"step\":5,\"accuracy\":0.9}\n");
  const auto summary = apps::write_report(dir.str(), dir / "report.html", "t");
  EXPECT_EQ(summary.tables, 2);  // the shallow bench summary (medians + ratios); the deep one and deep.json are skipped
  const auto page = read_bytes(dir / "report.html");
  expect_contains(page, "12.5");
  expect_contains(page, "90.00%");
}

// --- the command line ------------------------------------------------------------------------------

class ReliabilityCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    data_ = *dir_ / "mnist";
    testing::write_fake_mnist(data_, 32, 16);
    run_ = *dir_ / "run";
    first_ = run_command(kCli + " train --data " + data_ + " --out " + run_ + " --steps 2 --batch-size 16 --no-progress");
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string train_into(const std::string& out, const std::string& extra) {
    return kCli + " train --data " + data_ + " --out " + out + " --steps 1 --batch-size 16 --no-progress --no-eval " +
           extra;
  }
  static TempDir* dir_;
  static std::string data_, run_;
  static testing::CommandResult first_;
};
TempDir* ReliabilityCli::dir_ = nullptr;
std::string ReliabilityCli::data_, ReliabilityCli::run_;
testing::CommandResult ReliabilityCli::first_;

TEST_F(ReliabilityCli, APreviousRunIsNotOverwrittenWithoutBeingAsked) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  const auto metrics_before = read_bytes(run_ + "/metrics.jsonl");
  const auto checkpoint_before = read_bytes(run_ + "/checkpoint.pt");
  auto r = run_command(train_into(run_, ""));
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "holds a previous run");
  expect_contains(r.output, "--resume");
  expect_contains(r.output, "--overwrite");
  EXPECT_EQ(read_bytes(run_ + "/metrics.jsonl"), metrics_before);
  EXPECT_EQ(read_bytes(run_ + "/checkpoint.pt"), checkpoint_before);

  // --overwrite replaces it; an empty or fresh folder needs nothing.
  const auto copy = *dir_ / "run_copy";
  fs::copy(run_, copy);
  r = run_command(train_into(copy, "--overwrite"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(read_bytes(copy + "/metrics.jsonl"), metrics_before);
  r = run_command(train_into(*dir_ / "fresh", ""));
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_F(ReliabilityCli, ResumingAnotherRunIntoAFolderThatHoldsARunIsRefused) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  auto resume_into = [&](const std::string& out, const std::string& checkpoint, const std::string& extra) {
    return kCli + " train --data " + data_ + " --out " + out + " --steps 3 --batch-size 16 --no-progress --no-eval " +
           "--resume " + checkpoint + " " + extra;
  };
  // B holds a run of its own; resuming run_ (A) into B would replace B's checkpoint and metrics.
  const auto other = *dir_ / "other_run";
  auto r = run_command(train_into(other, ""));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto metrics_before = read_bytes(other + "/metrics.jsonl");
  const auto checkpoint_before = read_bytes(other + "/checkpoint.pt");
  const auto a = run_ + "/checkpoint.pt";
  r = run_command(resume_into(other, a, ""));
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "holds another run");
  expect_contains(r.output, "--overwrite");
  EXPECT_EQ(read_bytes(other + "/metrics.jsonl"), metrics_before);
  EXPECT_EQ(read_bytes(other + "/checkpoint.pt"), checkpoint_before);

  // Into an empty folder, or with --overwrite, it continues A; B resuming its own checkpoint needs nothing.
  r = run_command(resume_into(*dir_ / "continued", a, ""));
  EXPECT_EQ(r.status, 0) << r.output;
  r = run_command(resume_into(other, other + "/checkpoint.pt", ""));
  EXPECT_EQ(r.status, 0) << r.output;
  r = run_command(resume_into(other, a, "--overwrite"));
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_F(ReliabilityCli, ServeRefusesAnEmptyHost) {
  // An empty address would bind every interface with the Host-header check off.
  auto r = run_command(kCli + " serve --checkpoint " + run_ + "/checkpoint.pt --port 0 --host ''");
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "an empty --host is refused");
}

TEST_F(ReliabilityCli, AnOutputIsNeverWrittenOverTheCheckpointItReads) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  const auto ckpt = run_ + "/checkpoint.pt";
  const auto before = read_bytes(ckpt);
  auto r = run_command(kCli + " reconstruct --data " + data_ + " --checkpoint " + ckpt + " --out " + ckpt);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "is the input");
  EXPECT_EQ(read_bytes(ckpt), before);
}

TEST_F(ReliabilityCli, NumericFlagsOutsideTheirDocumentedRangeAreRefusedBeforeUse) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--batch-size 9223372036854775807", "out of range"},
      {"--epochs 4611686018427387904", "out of range"},
      {"--seed -1", "out of range"},
      {"--seed 18446744073709551616", "out of range"},
      {"--threads 100000", "out of range"},
      {"--lr nan", "out of range"},
      {"--batch-size 12abc", "12abc"},
  };
  for (const auto& [flags, phrase] : cases) {
    auto r = run_command(train_into(*dir_ / "never", flags));
    EXPECT_NE(r.status, 0) << flags << "\n" << r.output;
    expect_contains(r.output, phrase);
    EXPECT_FALSE(fs::exists(*dir_ / "never/metrics.jsonl")) << flags;
  }
  // The other training commands: the same table, checked before any data is read or folder made.
  const auto never = *dir_ / "never_other";
  const std::vector<std::string> commands = {
      "multimnist --batch-size 9223372036854775807", "multimnist --test-size 100000000",
      "multimnist --seed -1",                         "multimnist --steps 4611686018427387904",
      "em --batch-size 100000",                       "em --routing-iters 101",
      "em --lambda-first nan",                        "em --train-size -5",
      "ablation --batch-size 9223372036854775807",    "ablation --epochs 4611686018427387904",
      "ablation --routing 1,1000",                    "ablation --seed 18446744073709551616",
  };
  for (const auto& command : commands) {
    auto r = run_command(kCli + " " + command + " --data " + data_ + " --out " + never + " --no-progress");
    EXPECT_NE(r.status, 0) << command << "\n" << r.output;
    expect_contains(r.output, "out of range");
    EXPECT_FALSE(fs::exists(never)) << command << " wrote into --out";
  }
}

// docs/reliability.md prints the ranges: its table is exactly what `capsnet help limits` prints now.
TEST(Reliability, TheDocumentedRangeTableIsTheOneTheToolPrints) {
  auto r = capsnet::testing::run_cli("help limits");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream doc(std::string(CAPSNET_SOURCE_DIR) + "/docs/reliability.md");
  ASSERT_TRUE(doc.good());
  std::string documented, line;
  bool in_table = false;
  while (std::getline(doc, line)) {
    if (line == "| flag | range | kind |") in_table = true;
    if (in_table && line.rfind("|", 0) != 0) break;
    if (in_table) documented += line + "\n";
  }
  ASSERT_FALSE(documented.empty()) << "no range table in docs/reliability.md";
  EXPECT_NE(r.output.find(documented), std::string::npos)
      << "docs/reliability.md's table differs from `capsnet help limits`; paste the command's output:\n"
      << r.output;
}

TEST_F(ReliabilityCli, AblationKeepsAnEarlierRunWithOtherSettingsUnlessToldToOverwrite) {
  const auto out = *dir_ / "ablation";
  const auto ablation = kCli + " ablation --data " + data_ + " --out " + out +
                        " --routing 1 --reconstruction off --batch-size 8 --test-limit 8 --no-progress";
  auto r = run_command(ablation + " --steps 1");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto result = out + "/r1_norecon/result.json";
  const auto before = read_bytes(result);
  // Other settings: refused before anything is trained or removed, naming the way out.
  r = run_command(ablation + " --steps 2");
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "r1_norecon");
  expect_contains(r.output, "other settings");
  expect_contains(r.output, "--overwrite");
  EXPECT_EQ(read_bytes(result), before);
  // An unfinished run with the same settings (killed before its result) is its own to replace.
  fs::remove(result);
  r = run_command(ablation + " --steps 1");
  EXPECT_EQ(r.status, 0) << r.output;
  expect_contains(r.output, "training");
  // --overwrite replaces a run with other settings.
  r = run_command(ablation + " --steps 2 --overwrite");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(read_bytes(result)).at("steps"), 2);
}

TEST_F(ReliabilityCli, TwoClassCheckpointsAndNegativeStepsGiveOneClearLine) {
  // A real 2-class model evaluated on 10-class data, and a checkpoint with a negative step.
  auto config = tiny_config();
  config.image_size = 28;
  config.num_classes = 2;
  models::CapsNet model(config);
  const auto two = *dir_ / "two_classes.pt", negative = *dir_ / "negative_step.pt";
  train::save_checkpoint(two, model, nullptr, {1, config.to_json(), nlohmann::json::object()});
  train::save_checkpoint(negative, model, nullptr, {-3, config.to_json(), nlohmann::json::object()});
  for (const auto& [checkpoint, phrase] : std::vector<std::pair<std::string, std::string>>{
           {two, "2 classes"}, {negative, "negative step -3"}}) {
    auto r = run_command(kCli + " eval --data " + data_ + " --checkpoint " + checkpoint);
    EXPECT_EQ(r.status, 1) << r.output;
    expect_contains(r.output, phrase);
    EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("index"), std::string::npos) << r.output;
  }
}

TEST_F(ReliabilityCli, OutputsAreCheckedAndNeverReplaceTheFilesACommandReads) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  const auto ckpt = run_ + "/checkpoint.pt";
  const auto before = read_bytes(ckpt);
  const auto images = data_ + "/t10k-images-idx3-ubyte";
  // predict: a full device is an error, not "wrote N predictions"; the checkpoint is an input too.
  if (fs::exists("/dev/full")) {
    auto r = run_command(kCli + " predict --checkpoint " + ckpt + " --output /dev/full " + images);
    EXPECT_EQ(r.status, 1) << r.output;
    expect_contains(r.output, "cannot write the predictions to /dev/full");
    EXPECT_EQ(r.output.find("wrote"), std::string::npos) << r.output;
  }
  auto r = run_command(kCli + " predict --checkpoint " + ckpt + " --output " + ckpt + " " + images);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "is the input");
  // report: its page may replace an earlier page, never a checkpoint or result under --runs.
  r = run_command(kCli + " report --runs " + dir_->str() + " --out " + ckpt);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "is the input");
  EXPECT_EQ(read_bytes(ckpt), before);
  r = run_command(kCli + " report --runs " + dir_->str() + " --out " + (*dir_ / "report.html"));
  EXPECT_EQ(r.status, 0) << r.output;
  r = run_command(kCli + " report --runs " + dir_->str() + " --out " + (*dir_ / "report.html"));
  EXPECT_EQ(r.status, 0) << r.output;
  // bench: --jsonl is appended to, so it must not be the Python or a script the bench runs.
  const auto script = *dir_ / "peer.py";
  write_bytes(script, "print('peer')\n");
  r = run_command(kCli + " bench --configs fused --repeats 1 --steps 1 --infer-batches 1 --latency-runs 1 "
                         "--peer-script " + script + " --jsonl " + script);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "is the input");
  EXPECT_EQ(read_bytes(script), "print('peer')\n");

  // Every file a command reads counts, not only the checkpoint: reconstruct's IDX files, predict's
  // images inside a folder it was given, export's card.
  const auto images_before = read_bytes(images);
  r = run_command(kCli + " reconstruct --checkpoint " + ckpt + " --data " + data_ + " --out " + images);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "is the input");
  EXPECT_EQ(read_bytes(images), images_before);
  const auto folder = *dir_ / "pngs";
  fs::create_directories(folder + "/sub");
  auto png = run_command(kCli + " reconstruct --checkpoint " + ckpt + " --data " + data_ + " --correct 1 --wrong 0 --out " +
                         folder + "/sub/0.png");
  ASSERT_EQ(png.status, 0) << png.output;
  const auto png_before = read_bytes(folder + "/sub/0.png");
  r = run_command(kCli + " predict --checkpoint " + ckpt + " --output " + folder + "/sub/0.png " + folder);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "is the input");
  EXPECT_EQ(read_bytes(folder + "/sub/0.png"), png_before);
  const auto card = *dir_ / "card.json";
  write_bytes(card, "{\"dataset\": \"mnist\"}");
  r = run_command(kCli + " export --checkpoint " + ckpt + " --card " + card + " --out " + card);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "is the input");
  EXPECT_EQ(read_bytes(card), "{\"dataset\": \"mnist\"}");
}

TEST_F(ReliabilityCli, PredictInSmallBatchesAnswersExactlyAsInOneBatch) {
  // Memory is bounded by --batch-size because predict decodes, runs and writes one batch at a time;
  // the answers must not depend on where the batches split.
  ASSERT_EQ(first_.status, 0) << first_.output;
  const auto images = data_ + "/t10k-images-idx3-ubyte";
  const auto predict = kCli + " predict --checkpoint " + run_ + "/checkpoint.pt --format csv --pose " + images;
  auto small = run_command(predict + " --batch-size 3");
  auto whole = run_command(predict + " --batch-size 256");
  ASSERT_EQ(small.status, 0) << small.output;
  ASSERT_EQ(whole.status, 0) << whole.output;
  EXPECT_EQ(small.output, whole.output);
  int rows = 0;
  for (char c : whole.output) rows += c == '\n';
  EXPECT_EQ(rows, 1 + 16) << whole.output;  // the header and one row per test image
}

TEST_F(ReliabilityCli, ProcessAndThreadCountsBeyondTheMachineAreRefusedOrIgnoredWithANotice) {
  // 64 processes pass the flag's range but not this machine's cores or memory (checked before any
  // process starts, so nothing is written).
  auto r = run_command(train_into(*dir_ / "nproc", "--nproc 64"));
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "--nproc 64");
  EXPECT_FALSE(fs::exists(*dir_ / "nproc/metrics.jsonl"));
  // CAPSNET_THREADS outside 0..256 is ignored with a notice, and the command still runs.
  r = run_command("CAPSNET_THREADS=100000 " + train_into(*dir_ / "threads", ""));
  EXPECT_EQ(r.status, 0) << r.output;
  expect_contains(r.output, "ignoring CAPSNET_THREADS=100000");
}

TEST_F(ReliabilityCli, ServeStopsCleanlyOnSigtermAndSigint) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  for (const std::string sig : {"TERM", "INT"}) {
    const auto log = *dir_ / ("serve_" + sig + ".log");
    // Start, wait (bounded) for the ready line, signal, wait (bounded) for the exit, and report the exit
    // status; a server that ignores the signal is killed after 30 s (exit=137) instead of hanging.
    const auto script = kCli + " serve --checkpoint " + run_ + "/checkpoint.pt --port 0 --runs " + dir_->str() + " > " +
                        log + " 2>&1 & p=$!; for i in $(seq 1 300); do grep -q \"Ctrl-C stops\" " + log +
                        " && break; sleep 0.1; done; kill -" + sig +
                        " $p; for i in $(seq 1 300); do kill -0 $p 2>/dev/null || break; sleep 0.1; done; "
                        "kill -KILL $p 2>/dev/null; wait $p; echo exit=$?";
    auto r = run_command("sh -c '" + script + "'");
    const auto out = read_bytes(log);
    expect_contains(out, "Ctrl-C stops");
    expect_contains(out, "capsnet serve: stopped");
    expect_contains(r.output, "exit=0");
  }
}

TEST(Reliability, EvaluatingAModelWithFewerClassesThanTheLabelsSaysSo) {
  auto config = testing::tiny_config();  // 10 classes
  models::CapsNet model(config);
  data::ImageSet set{torch::zeros({4, config.image_size, config.image_size}, torch::kUInt8),
                     torch::tensor({0, 3, 12, 1}, torch::kLong)};
  try {
    train::evaluate(model, set, 2);
    FAIL() << "labels up to 12 accepted by a 10-class model";
  } catch (const std::invalid_argument& e) {
    expect_contains(e.what(), "labels 0..12");
    expect_contains(e.what(), "10 classes");
  }
}

TEST_F(ReliabilityCli, LibTorchErrorsAreOneLineAndTheTraceIsBehindVerbose) {
  const auto empty_zip = *dir_ / "empty.pt";
  // An empty zip archive: the end-of-central-directory record alone.
  write_bytes(empty_zip, std::string("PK\x05\x06", 4) + std::string(18, '\0'));
  auto r = run_command(kCli + " eval --data " + data_ + " --checkpoint " + empty_zip);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "capsnet: error:");
  expect_contains(r.output, empty_zip);
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
  int lines = 0;
  for (char c : r.output) lines += c == '\n';
  EXPECT_LE(lines, 2) << r.output;  // a blank separator line and the message
}

TEST_F(ReliabilityCli, AZipBombGivenAsAModelIsRefusedBeforeItIsInflated) {
  // 256 MiB declared in a ~250 KB file: each command answers with one line and stays far below it.
  const auto bomb = *dir_ / "bomb.pt";
  write_bytes(bomb, zip_of_zeros("archive/data.pkl", 256u << 20));
  for (const auto& command : {kCli + " eval --data " + data_ + " --checkpoint " + bomb,
                              kCli + " predict --checkpoint " + bomb + " " + data_ + "/t10k-images-idx3-ubyte",
                              kCli + " export --checkpoint " + bomb + " --out " + (*dir_ / "bomb-export.pt")}) {
    const auto r = run_command("/usr/bin/time -f 'peak-kb %M' " + command);
    EXPECT_EQ(r.status, 1) << command << "\n" << r.output;
    expect_contains(r.output, "refused before reading");
    const auto at = r.output.rfind("peak-kb ");
    ASSERT_NE(at, std::string::npos) << r.output;
    EXPECT_LT(std::stol(r.output.substr(at + 8)), 200 * 1024) << command << "\n" << r.output;
  }
}

TEST_F(ReliabilityCli, FifosAndDevicesGivenAsInputsAreRefusedNotWaitedOn) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  const auto ckpt = run_ + "/checkpoint.pt";
  const auto fifo = *dir_ / "pipe", fifo_png = *dir_ / "pipe.png";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo(fifo_png.c_str(), 0600), 0);
  struct Case {
    std::string args, phrase;
  };
  std::vector<Case> cases = {
      {"eval --checkpoint " + fifo + " --data " + data_, "not a regular file"},
      {"predict --checkpoint " + fifo + " " + data_ + "/t10k-images-idx3-ubyte", "not a regular file"},
      {"predict --checkpoint " + ckpt + " " + fifo_png, "not a regular file"},
      {"export --checkpoint " + ckpt + " --card " + fifo + " --out " + (*dir_ / "w.pt"), "not a regular file"},
      {"train --data " + data_ + " --out " + (*dir_ / "r") + " --steps 1 --resume " + fifo, "not a regular file"},
  };
  if (fs::exists("/dev/zero")) cases.push_back({"eval --checkpoint /dev/zero --data " + data_, "not a regular file"});
  for (const auto& c : cases) {
    // `timeout`: before the check, open() on a FIFO waited for a writer forever.
    const auto r = run_command("timeout 120 " + kCli + " " + c.args);
    EXPECT_NE(r.status, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.status, 124) << "timed out: " << c.args;
    expect_contains(r.output, c.phrase);
  }
}

TEST_F(ReliabilityCli, OutputsThatAreNotRegularFilesAreNeverReplaced) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  const auto ckpt = run_ + "/checkpoint.pt";
  // A FIFO as the weight file (written to a temporary and renamed over) or as a PNG (written in place)
  // is refused, and stays a FIFO; nothing waits on it.
  const auto fifo = *dir_ / "out-fifo", fifo_png = *dir_ / "out-fifo.png";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo(fifo_png.c_str(), 0600), 0);
  auto r = run_command("timeout 120 " + kCli + " export --checkpoint " + ckpt + " --out " + fifo);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "timed out";
  expect_contains(r.output, "not a regular file");
  EXPECT_TRUE(fs::is_fifo(fifo));
  r = run_command("timeout 120 " + kCli + " reconstruct --checkpoint " + ckpt + " --data " + data_ +
                  " --correct 1 --wrong 0 --out " + fifo_png);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "timed out";
  expect_contains(r.output, "FIFO");
  EXPECT_TRUE(fs::is_fifo(fifo_png));
  // A character device is written straight (never renamed over or unlinked): /dev/null stays one.
  if (fs::is_character_file("/dev/null")) {
    r = run_command(kCli + " reconstruct --checkpoint " + ckpt + " --data " + data_ +
                    " --correct 1 --wrong 0 --out /dev/null");
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_TRUE(fs::is_character_file("/dev/null"));
  }
}

TEST_F(ReliabilityCli, PredictClassifiesEveryReadableInputAndListsTheOthers) {
  ASSERT_EQ(first_.status, 0) << first_.output;
  const auto ckpt = run_ + "/checkpoint.pt";
  const auto images = data_ + "/t10k-images-idx3-ubyte";
  const auto bad_png = *dir_ / "broken.png", bad_idx = *dir_ / "broken-idx";
  write_bytes(bad_png, "not a png at all");
  write_bytes(bad_idx, "not an idx file");
  const auto r = run_command(kCli + " predict --checkpoint " + ckpt + " --limit 2 --format csv " + images + " " +
                             bad_png + " " + bad_idx + " " + images);
  EXPECT_EQ(r.status, 1) << r.output;
  expect_contains(r.output, "skipped " + bad_png);
  expect_contains(r.output, "skipped " + bad_idx);
  expect_contains(r.output, "2 inputs could not be read");
  int rows = 0;  // 2 images from each readable IDX file, in input order around the bad ones
  for (size_t at = 0; (at = r.output.find(images + "[", at)) != std::string::npos; ++at) ++rows;
  EXPECT_EQ(rows, 4) << r.output;
}

}  // namespace
}  // namespace capsnet

namespace capsnet {
namespace {

// --- data files ------------------------------------------------------------------------------------

TEST(ReliabilityData, AFifoGivenAsAnIdxFileIsRefusedNotWaitedOn) {
  TempDir dir;
  const auto fifo = dir / "images";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    data::read_idx(fifo);
    FAIL() << "read a FIFO";
  } catch (const data::IdxError& e) {
    expect_contains(e.what(), "not a regular file");
  }
}

TEST(ReliabilityData, ASymlinkLoopIsNamedAsSuchNotAsAMissingFile) {
  TempDir dir;
  fs::create_symlink(dir / "b", dir / "a");
  fs::create_symlink(dir / "a", dir / "b");
  try {
    data::read_idx(dir / "a");
    FAIL() << "read a symlink loop";
  } catch (const data::IdxError& e) {
    expect_contains(e.what(), "symbolic links");
  }
  fs::create_symlink("train-images-idx3-ubyte", dir / "train-images-idx3-ubyte");  // points at itself
  try {
    data::load_mnist(dir.str(), data::Split::kTrain);
    FAIL() << "loaded a symlink loop";
  } catch (const data::IdxError& e) {
    EXPECT_EQ(std::string(e.what()).find("missing"), std::string::npos) << e.what();
    expect_contains(e.what(), "symbolic links");
  }
}

TEST(ReliabilityData, AGzipBombStopsAtItsDeclaredSize) {
  TempDir dir;
  // Header: 1-D, 16 bytes of data; then 256 MiB of zeros (a ~250 KB file).
  const auto path = dir / "bomb.gz";
  gzFile f = gzopen(path.c_str(), "wb9");
  const unsigned char header[8] = {0, 0, 0x08, 1, 0, 0, 0, 16};
  ASSERT_EQ(gzwrite(f, header, sizeof header), 8);
  std::vector<char> zeros(1 << 20, 0);
  for (int i = 0; i < 256; ++i) ASSERT_EQ(gzwrite(f, zeros.data(), zeros.size()), static_cast<int>(zeros.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
  try {
    data::read_idx(path);
    FAIL() << "loaded a gzip bomb";
  } catch (const data::IdxError& e) {
    // "at least": reading stopped 1 MiB past the declared size instead of inflating all 256 MiB.
    expect_contains(e.what(), "at least");
    expect_contains(e.what(), "trailing bytes");
  }
  // A header that declares more than the reader accepts is refused before anything is inflated.
  const auto big = dir / "big.gz";
  f = gzopen(big.c_str(), "wb");
  const unsigned char huge[12] = {0, 0, 0x08, 2, 0x7F, 0xFF, 0xFF, 0xFF, 0, 0, 0, 4};
  ASSERT_EQ(gzwrite(f, huge, sizeof huge), 12);
  ASSERT_EQ(gzclose(f), Z_OK);
  try {
    data::read_idx(big);
    FAIL() << "accepted 8 GiB declared in a .gz";
  } catch (const data::IdxError& e) {
    expect_contains(e.what(), "more than");
  }
}

}  // namespace
}  // namespace capsnet
