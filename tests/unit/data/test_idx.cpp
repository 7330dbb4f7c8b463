// IDX reader/writer and MNIST loading: round trips, and every malformed file rejected by name.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include "capsnet/data/idx.h"
#include "capsnet/data/mnist.h"

namespace fs = std::filesystem;
using capsnet::data::IdxError;
using capsnet::data::read_idx;
using capsnet::data::write_idx;
using Bytes = std::vector<uint8_t>;

namespace {

// A fresh directory per test, removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("capsnet_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

// Runs f, which must throw IdxError; returns its message.
std::string idx_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const IdxError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected IdxError";
  return "";
}

// The message must start with the path and contain the phrase.
void expect_read_error(const std::string& path, const std::string& phrase) {
  const std::string msg = idx_error([&] { read_idx(path); });
  EXPECT_EQ(msg.rfind(path + ": ", 0), 0u) << msg;
  EXPECT_NE(msg.find(phrase), std::string::npos) << "'" << phrase << "' not in: " << msg;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

torch::Tensor random_u8(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randint(0, 256, shape, gen, torch::kUInt8);
}

}  // namespace

class IdxTest : public TempDirTest {};

TEST_F(IdxTest, RoundTrip1D) {
  auto t = torch::arange(0, 200).to(torch::kUInt8);
  write_idx(path("a"), t);
  EXPECT_EQ(fs::file_size(path("a")), 4u + 4u + 200u);
  auto r = read_idx(path("a"));
  EXPECT_EQ(r.scalar_type(), torch::kUInt8);
  EXPECT_EQ(r.sizes(), t.sizes());
  EXPECT_TRUE(torch::equal(r, t));
}

TEST_F(IdxTest, RoundTrip3DWithExactHeader) {
  auto t = random_u8({5, 7, 300}, 1);
  write_idx(path("b"), t);
  const Bytes b = read_bytes(path("b"));
  ASSERT_EQ(b.size(), 4u + 12u + 5u * 7u * 300u);
  const Bytes header(b.begin(), b.begin() + 16);
  EXPECT_EQ(header, (Bytes{0, 0, 8, 3, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 1, 44}));  // 300 = 0x012C
  EXPECT_EQ(b[16], t[0][0][0].item<int>());
  EXPECT_TRUE(torch::equal(read_idx(path("b")), t));
}

TEST_F(IdxTest, WriteMakesNonContiguousInputContiguous) {
  auto t = random_u8({3, 4, 5, 6}, 2).permute({3, 1, 0, 2});
  ASSERT_FALSE(t.is_contiguous());
  write_idx(path("c"), t);
  EXPECT_TRUE(torch::equal(read_idx(path("c")), t));
}

TEST_F(IdxTest, GzRoundTrip) {
  auto t = random_u8({10, 28, 28}, 3);
  write_idx(path("g.gz"), t);
  const Bytes b = read_bytes(path("g.gz"));
  ASSERT_GE(b.size(), 2u);
  EXPECT_EQ(b[0], 0x1f);  // gzip magic: really compressed
  EXPECT_EQ(b[1], 0x8b);
  EXPECT_TRUE(torch::equal(read_idx(path("g.gz")), t));
}

TEST_F(IdxTest, MissingFile) { expect_read_error(path("nope"), "cannot open: No such file or directory"); }

TEST_F(IdxTest, MissingGzFile) { expect_read_error(path("nope.gz"), "cannot open"); }

TEST_F(IdxTest, Directory) { expect_read_error(dir_.string(), "is a directory"); }

TEST_F(IdxTest, BadMagic) {
  write_bytes(path("m"), {0x12, 0x34, 8, 1, 0, 0, 0, 1, 7});
  expect_read_error(path("m"), "bad magic 0x1234 (not an IDX file)");
}

TEST_F(IdxTest, UnsupportedType) {
  write_bytes(path("t"), {0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0});
  expect_read_error(path("t"), "unsupported IDX data type 0x0D");
}

TEST_F(IdxTest, ZeroOrTooManyDims) {
  write_bytes(path("z"), {0, 0, 8, 0});
  expect_read_error(path("z"), "number of dimensions 0");
  write_bytes(path("five"), {0, 0, 8, 5, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 9});
  expect_read_error(path("five"), "number of dimensions 5");
}

TEST_F(IdxTest, DimensionOfZero) {
  write_bytes(path("d"), {0, 0, 8, 2, 0, 0, 0, 3, 0, 0, 0, 0});
  expect_read_error(path("d"), "dimension 1 is 0");
}

TEST_F(IdxTest, TruncatedHeader) {
  write_bytes(path("h2"), {0, 0});
  expect_read_error(path("h2"), "truncated header");
  write_bytes(path("h"), {0, 0, 8, 3, 0, 0, 0, 5, 0, 0});
  expect_read_error(path("h"), "truncated header: 3 dimensions need 16 header bytes");
  write_bytes(path("empty"), {});
  expect_read_error(path("empty"), "truncated header");
}

TEST_F(IdxTest, TruncatedData) {
  Bytes b = {0, 0, 8, 3, 0, 0, 0xEA, 0x60, 0, 0, 0, 28, 0, 0, 0, 28};  // 60000 x 28 x 28
  b.resize(b.size() + 1000, 1);
  write_bytes(path("x"), b);
  const std::string msg = idx_error([&] { read_idx(path("x")); });
  EXPECT_EQ(msg, path("x") + ": truncated: header declares 47040000 bytes of data (60000x28x28) but "
                             "the file holds 1000");
}

TEST_F(IdxTest, TrailingBytes) {
  write_idx(path("tr"), torch::ones({4, 4}, torch::kUInt8));
  Bytes b = read_bytes(path("tr"));
  b.resize(b.size() + 16, 0);
  write_bytes(path("tr"), b);
  expect_read_error(path("tr"), "16 unexpected trailing bytes after the data");
}

TEST_F(IdxTest, HugeHeaderIsACleanError) {
  // 1000000 x 1000000 = 10^12 bytes: must be rejected from the file length, not by bad_alloc.
  write_bytes(path("big"), {0, 0, 8, 2, 0, 0x0F, 0x42, 0x40, 0, 0x0F, 0x42, 0x40, 1, 2, 3});
  expect_read_error(path("big"), "header declares 1000000000000 bytes of data (1000000x1000000) but "
                                 "the file holds 3");
  // (2^32 - 1)^4 overflows 64 bits.
  Bytes b = {0, 0, 8, 4};
  for (int i = 0; i < 16; ++i) b.push_back(0xFF);
  write_bytes(path("overflow"), b);
  expect_read_error(path("overflow"), "more than 2^64 bytes");
}

TEST_F(IdxTest, GzContentIsCheckedToo) {
  // A well-formed gzip stream whose IDX payload (2 x 4) is 2 bytes short.
  const Bytes idx = {0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 4, 1, 2, 3, 4, 5, 6};
  gzFile f = gzopen(path("short.gz").c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, idx.data(), static_cast<unsigned>(idx.size())), static_cast<int>(idx.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
  expect_read_error(path("short.gz"), "truncated: header declares 8 bytes of data (2x4) but the file holds 6");
}

TEST_F(IdxTest, CorruptGz) {
  write_idx(path("c.gz"), random_u8({50, 28, 28}, 4));
  const Bytes good = read_bytes(path("c.gz"));

  Bytes cut(good.begin(), good.begin() + good.size() / 2);
  write_bytes(path("cut.gz"), cut);
  expect_read_error(path("cut.gz"), "corrupt gzip data");

  Bytes flipped = good;
  for (size_t i = 20; i < 60; ++i) flipped[i] ^= 0x5A;
  write_bytes(path("flipped.gz"), flipped);
  expect_read_error(path("flipped.gz"), "corrupt gzip data");
}

TEST_F(IdxTest, WriteRejectsBadTensors) {
  const std::string p = path("w");
  EXPECT_TRUE(contains(idx_error([&] { write_idx(p, torch::zeros({3}, torch::kFloat)); }), "uint8"));
  EXPECT_TRUE(contains(idx_error([&] { write_idx(p, torch::zeros({}, torch::kUInt8)); }), "dimensions"));
  EXPECT_TRUE(
      contains(idx_error([&] { write_idx(p, torch::zeros({1, 1, 1, 1, 1}, torch::kUInt8)); }), "dimensions"));
  EXPECT_TRUE(contains(idx_error([&] { write_idx(p, torch::zeros({2, 0}, torch::kUInt8)); }), "size 0"));
  EXPECT_TRUE(contains(idx_error([&] { write_idx(path("no/such/dir/f"), torch::zeros({1}, torch::kUInt8)); }),
                       "cannot create"));
}

// --- MNIST ----------------------------------------------------------------------------------------

using capsnet::data::load_mnist;
using capsnet::data::Split;

class MnistFilesTest : public TempDirTest {
 protected:
  // Writes a small split: images [n, h, w], labels i % 10 (or the given ones).
  void write_split(Split split, int64_t n, int64_t h = 28, int64_t w = 28, const std::string& ext = "") {
    const std::string prefix = split == Split::kTrain ? "train" : "t10k";
    images_ = random_u8({n, h, w}, 5);
    labels_ = (torch::arange(n) % 10).to(torch::kUInt8);
    write_idx(path(prefix + "-images-idx3-ubyte" + ext), images_);
    write_idx(path(prefix + "-labels-idx1-ubyte" + ext), labels_);
  }
  std::string dir() const { return dir_.string(); }
  std::string load_error(Split split = Split::kTrain) {
    return idx_error([&] { load_mnist(dir(), split); });
  }

  torch::Tensor images_, labels_;
};

TEST_F(MnistFilesTest, LoadsSmallSplit) {
  write_split(Split::kTest, 12);
  auto set = load_mnist(dir(), Split::kTest);
  EXPECT_EQ(set.size(), 12);
  EXPECT_EQ(set.images.sizes(), (std::vector<int64_t>{12, 28, 28}));
  EXPECT_EQ(set.images.scalar_type(), torch::kUInt8);
  EXPECT_EQ(set.labels.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(set.images, images_));
  EXPECT_TRUE(torch::equal(set.labels, labels_.to(torch::kLong)));
}

TEST_F(MnistFilesTest, AcceptsGzWhenPlainIsMissing) {
  write_split(Split::kTrain, 7, 28, 28, ".gz");
  EXPECT_EQ(capsnet::data::mnist_images_path(dir(), Split::kTrain), path("train-images-idx3-ubyte.gz"));
  EXPECT_EQ(capsnet::data::mnist_labels_path(dir(), Split::kTrain), path("train-labels-idx1-ubyte.gz"));
  auto set = load_mnist(dir(), Split::kTrain);
  EXPECT_TRUE(torch::equal(set.images, images_));
}

TEST_F(MnistFilesTest, PrefersPlainFile) {
  write_split(Split::kTrain, 3);
  write_split(Split::kTrain, 3, 28, 28, ".gz");
  EXPECT_EQ(capsnet::data::mnist_images_path(dir(), Split::kTrain), path("train-images-idx3-ubyte"));
}

TEST_F(MnistFilesTest, MismatchedCount) {
  write_split(Split::kTrain, 5);
  write_idx(path("train-labels-idx1-ubyte"), torch::zeros({4}, torch::kUInt8));
  const std::string msg = load_error();
  EXPECT_EQ(msg.rfind(path("train-labels-idx1-ubyte") + ": ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "4 labels but")) << msg;
  EXPECT_TRUE(contains(msg, "has 5 images")) << msg;
}

TEST_F(MnistFilesTest, LabelOutOfRange) {
  write_split(Split::kTrain, 5);
  write_idx(path("train-labels-idx1-ubyte"), torch::tensor({1, 2, 10, 3, 4}, torch::kUInt8));
  const std::string msg = load_error();
  EXPECT_EQ(msg.rfind(path("train-labels-idx1-ubyte") + ": ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "label 10 at index 2")) << msg;
}

TEST_F(MnistFilesTest, WrongImageSize) {
  write_split(Split::kTrain, 5, 28, 27);
  const std::string msg = load_error();
  EXPECT_EQ(msg.rfind(path("train-images-idx3-ubyte") + ": ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "[N, 28, 28], got [5, 28, 27]")) << msg;
}

TEST_F(MnistFilesTest, LabelsNot1D) {
  write_split(Split::kTrain, 4);
  write_idx(path("train-labels-idx1-ubyte"), torch::zeros({4, 1}, torch::kUInt8));
  const std::string msg = load_error();
  EXPECT_EQ(msg.rfind(path("train-labels-idx1-ubyte") + ": ", 0), 0u) << msg;
}

TEST_F(MnistFilesTest, MissingDirectoryTellsHowToFetch) {
  const std::string missing = path("absent");
  const std::string msg = idx_error([&] { load_mnist(missing, Split::kTrain); });
  EXPECT_EQ(msg.rfind(missing + ": ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "scripts/fetch_mnist.sh")) << msg;
}

TEST_F(MnistFilesTest, MissingFileTellsHowToFetch) {
  write_split(Split::kTrain, 4);
  fs::remove(path("train-labels-idx1-ubyte"));
  std::string msg = load_error();
  EXPECT_EQ(msg.rfind(path("train-labels-idx1-ubyte") + ": ", 0), 0u) << msg;
  EXPECT_TRUE(contains(msg, "missing")) << msg;
  EXPECT_TRUE(contains(msg, "scripts/fetch_mnist.sh")) << msg;

  msg = load_error(Split::kTest);  // nothing of the test split was written
  EXPECT_TRUE(contains(msg, path("t10k-images-idx3-ubyte"))) << msg;
  EXPECT_TRUE(contains(msg, "scripts/fetch_mnist.sh")) << msg;
}

TEST_F(MnistFilesTest, CorruptFileIsNamed) {
  write_split(Split::kTrain, 4);
  write_bytes(path("train-images-idx3-ubyte"), {1, 2, 3, 4});
  const std::string msg = load_error();
  EXPECT_EQ(msg.rfind(path("train-images-idx3-ubyte") + ": bad magic", 0), 0u) << msg;
}

TEST_F(MnistFilesTest, Take) {
  write_split(Split::kTrain, 10);
  auto set = load_mnist(dir(), Split::kTrain);
  auto first = capsnet::data::take(set, 3);
  EXPECT_EQ(first.size(), 3);
  EXPECT_TRUE(torch::equal(first.images, set.images.narrow(0, 0, 3)));
  EXPECT_TRUE(torch::equal(first.labels, torch::tensor({0, 1, 2}, torch::kLong)));
  EXPECT_EQ(capsnet::data::take(set, 0).size(), 10);
  EXPECT_EQ(capsnet::data::take(set, -1).size(), 10);
  EXPECT_EQ(capsnet::data::take(set, 10).size(), 10);
  EXPECT_EQ(capsnet::data::take(set, 1000).size(), 10);
}

#ifdef CAPSNET_DATA_DIR
// The fetched files, when present: the 10k test images with their well-known first label (a 7).
TEST_F(MnistFilesTest, RealTestSplitIfFetched) {
  if (!fs::exists(capsnet::data::mnist_labels_path(CAPSNET_DATA_DIR, Split::kTest)))
    GTEST_SKIP() << "MNIST not fetched (scripts/fetch_mnist.sh)";
  auto set = load_mnist(CAPSNET_DATA_DIR, Split::kTest);
  EXPECT_EQ(set.size(), 10000);
  EXPECT_EQ(set.labels[0].item<int64_t>(), 7);
  EXPECT_TRUE(torch::equal(torch::bincount(set.labels).gt(800), torch::ones({10}, torch::kBool)));
}
#endif

TEST_F(IdxTest, MaxRowsReadsOnlyTheFirstRowsOfPlainAndGzFiles) {
  auto t = random_u8({9, 5, 4}, 11);
  write_idx(path("p"), t);
  write_idx(path("p.gz"), t);
  for (const auto* name : {"p", "p.gz"}) {
    for (int64_t rows : {1, 4, 8}) {
      const auto r = read_idx(path(name), rows);
      EXPECT_EQ(r.sizes(), (std::vector<int64_t>{rows, 5, 4})) << name;
      EXPECT_TRUE(torch::equal(r, t.narrow(0, 0, rows))) << name << " rows " << rows;
    }
    EXPECT_TRUE(torch::equal(read_idx(path(name), 9), t)) << name;   // exactly all
    EXPECT_TRUE(torch::equal(read_idx(path(name), 50), t)) << name;  // more than there are
    EXPECT_TRUE(torch::equal(read_idx(path(name), 0), t)) << name;   // 0 = all
  }
  // A plain file is still checked against its size; a .gz only up to the rows read: a stream cut after
  // row 3 gives rows 0..2, and fails for more.
  Bytes plain = read_bytes(path("p"));
  plain.push_back(0);
  write_bytes(path("long"), plain);
  expect_read_error(path("long"), "trailing");
  EXPECT_NE(idx_error([&] { read_idx(path("long"), 2); }).find("trailing"), std::string::npos);
  const Bytes cut(plain.begin(), plain.begin() + 4 + 12 + 3 * 20);
  {
    gzFile gz = gzopen(path("cut.gz").c_str(), "wb");
    ASSERT_NE(gz, nullptr);
    ASSERT_EQ(gzwrite(gz, cut.data(), static_cast<unsigned>(cut.size())), static_cast<int>(cut.size()));
    gzclose(gz);
  }
  EXPECT_TRUE(torch::equal(read_idx(path("cut.gz"), 3), t.narrow(0, 0, 3)));
  EXPECT_NE(idx_error([&] { read_idx(path("cut.gz"), 4); }).find("truncated"), std::string::npos);
  expect_read_error(path("cut.gz"), "truncated");
}
