#pragma once
// Shared fixtures for the training, checkpoint and CLI tests: temp dirs, tiny models, synthetic data.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "capsnet/data/idx.h"
#include "capsnet/data/mnist.h"
#include "capsnet/models/capsnet.h"

namespace capsnet::testing {

/// A fresh, empty directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("capsnet_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string str() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

/// The bytes of the file at `path` ("" when it cannot be read).
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Replaces the file at `path` with `bytes`.
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

/// A small CapsNet (12x12 input, 64 primary capsules) that trains in milliseconds per step.
inline models::CapsNetConfig tiny_config() {
  models::CapsNetConfig c;
  c.image_size = 12;
  c.conv1_channels = 8;
  c.conv1_kernel = 3;
  c.primary_types = 4;
  c.primary_dim = 4;
  c.primary_kernel = 3;
  c.primary_stride = 2;
  c.digit_dim = 4;
  return c;
}

/// Learnable synthetic digits: class k lights a k-dependent bar, plus seeded noise. images [N, S, S] uint8.
inline data::ImageSet synthetic_set(int64_t n, int64_t side, uint64_t seed) {
  torch::manual_seed(seed);
  data::ImageSet set;
  set.labels = torch::arange(n, torch::kLong) % 10;
  set.images = (torch::rand({n, side, side}) * 60).to(torch::kUInt8);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = set.labels[i].item<int64_t>();
    set.images[i].narrow(0, (k * side) / 10, std::max<int64_t>(1, side / 10)).fill_(255);
  }
  return set;
}

/// Writes the four MNIST IDX files of `train` and `test` into `dir` (created if missing).
inline void write_mnist_dir(const std::string& dir, const data::ImageSet& train, const data::ImageSet& test) {
  std::filesystem::create_directories(dir);
  data::write_idx(dir + "/train-images-idx3-ubyte", train.images);
  data::write_idx(dir + "/train-labels-idx1-ubyte", train.labels.to(torch::kUInt8));
  data::write_idx(dir + "/t10k-images-idx3-ubyte", test.images);
  data::write_idx(dir + "/t10k-labels-idx1-ubyte", test.labels.to(torch::kUInt8));
}

/// An MNIST directory of synthetic 28x28 digits (synthetic_set with the given seeds).
inline void write_fake_mnist(const std::string& dir, int64_t n_train, int64_t n_test, uint64_t train_seed = 11,
                             uint64_t test_seed = 12) {
  write_mnist_dir(dir, synthetic_set(n_train, 28, train_seed), synthetic_set(n_test, 28, test_seed));
}

/// Runs a shell command, returns its exit status and combined stdout+stderr.
struct CommandResult {
  int status = -1;
  std::string output;
};
inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, got);
  const int raw = ::pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return r;
}

}  // namespace capsnet::testing
