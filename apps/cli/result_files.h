#pragma once
// The result files the experiment commands write beside their checkpoints: the summary JSON and the
// figures, each announced on stdout with what it holds.

#include <torch/torch.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

namespace capsnet::apps::cli {

/// Sets summary["seconds"] to the time since `start`, writes the summary (indented JSON) to `path` and
/// prints "wrote PATH (S s in all)". std::runtime_error naming the path when it cannot be written.
void write_summary(const std::string& path, nlohmann::json& summary, std::chrono::steady_clock::time_point start);

/// Writes a grey figure [H, W] (uint8 or float in [0, 1], viz::write_png_gray) as a PNG at `path` and
/// prints "wrote PATH (W x H px)".
void write_figure(const std::string& path, const torch::Tensor& figure);

}  // namespace capsnet::apps::cli
