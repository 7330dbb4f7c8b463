// The trained model that ships in the repository (models/capsnet-mnist/), used by every command that
// needs a model when no --checkpoint is given.
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <stdexcept>

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

}  // namespace

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
