// The trained model that ships in the repository (models/capsnet-mnist/), used by every command that
// needs a model when no --checkpoint is given.
#include <fmt/format.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "capsnet/train/export.h"
#include "apps/cli/commands.h"

#ifndef CAPSNET_SOURCE_DIR
#define CAPSNET_SOURCE_DIR "."
#endif

namespace capsnet::apps::cli {
namespace {

std::filesystem::path executable_dir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path() : exe.parent_path();
}

/// SHA-256 of a file's bytes, in lowercase hex (OpenSSL's EVP digest).
std::string sha256_hex(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot be read", path.string()));
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1)
    throw std::runtime_error("SHA-256: OpenSSL could not start a digest");
  std::vector<char> buffer(1 << 20);
  while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0) {
    EVP_DigestUpdate(ctx.get(), buffer.data(), static_cast<size_t>(in.gcount()));
    if (in.eof()) break;
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &length);
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

}  // namespace

void check_sha256sums(const std::string& file) {
  const std::filesystem::path path(file);
  const auto sums = path.parent_path() / "SHA256SUMS";
  std::ifstream in(sums);
  if (!in)
    throw std::invalid_argument(fmt::format("{}: no SHA256SUMS beside it to check it against ({})", file, sums.string()));
  const auto name = path.filename().string();
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string expected, listed;
    fields >> expected >> listed;
    if (!listed.empty() && listed.front() == '*') listed.erase(0, 1);  // sha256sum's binary mode
    if (listed != name) continue;
    const auto actual = sha256_hex(path);
    if (actual != expected)
      throw std::invalid_argument(fmt::format(
          "{} does not match its SHA-256 in {} (expected {}, the file has {}): it was damaged or changed; restore "
          "it (git checkout -- {}) or give --checkpoint",
          file, sums.string(), expected, actual, file));
    return;
  }
  throw std::invalid_argument(fmt::format("{}: {} lists no SHA-256 for {}", file, sums.string(), name));
}

std::string shipped_model_path() {
  const auto relative = std::filesystem::path(kShippedModel);
  // build/bin/capsnet -> the checkout it was built from; then the source tree it was configured in.
  std::vector<std::filesystem::path> candidates;
  if (auto dir = executable_dir(); !dir.empty()) candidates.push_back(dir / ".." / ".." / relative);
  candidates.push_back(std::filesystem::path(CAPSNET_SOURCE_DIR) / relative);
  for (const auto& c : candidates) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(c, ec)) return std::filesystem::weakly_canonical(c, ec).string();
  }
  throw std::invalid_argument(fmt::format(
      "no --checkpoint given and the shipped model {} is not in this checkout (looked in {}): give --checkpoint",
      kShippedModel, candidates.back().parent_path().string()));
}

std::string checkpoint_or_shipped(const std::string& checkpoint) {
  if (!checkpoint.empty()) return checkpoint;
  const auto path = shipped_model_path();
  check_sha256sums(path);  // a model used without being named must be the one the card describes
  const auto card = train::read_weights(path).card;
  std::string summary;
  if (card.is_object())
    summary = fmt::format(" ({}, {} epochs, {:.2f}% test accuracy)", card.value("dataset", std::string("?")),
                          card.value("epochs", 0), 100 * card.value("test_accuracy", 0.0));
  // stderr: commands that print JSON or CSV on stdout keep it clean.
  std::cerr << fmt::format("no --checkpoint given: using the shipped model {}{}\n", path, summary);
  return path;
}

}  // namespace capsnet::apps::cli
