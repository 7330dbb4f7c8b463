#pragma once
// Grayscale PNG reading and writing (libpng's simplified API).

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace capsnet::viz {

class PngError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Reads any PNG (gray, RGB, palette, alpha; composited on black) as 8-bit gray: uint8 [H, W].
/// Refuses images over 4096x4096. Throws PngError naming the file.
torch::Tensor read_png_gray(const std::string& path);

/// Writes uint8 [H, W] (or float [H, W] in [0, 1], clamped) as an 8-bit grayscale PNG.
void write_png_gray(const std::string& path, const torch::Tensor& image);

}  // namespace capsnet::viz
