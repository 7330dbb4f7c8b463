#pragma once
// Single image files (PNG through libpng, JPEG through libjpeg-turbo) as uint8 tensors, and the
// resize / pad that brings an image of any size to a model's square input.

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace capsnet::data {

/// Thrown for unreadable, corrupt, unsupported or oversized image files; what() names the file.
class ImageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Largest side accepted (a guard against decompression bombs and mistaken inputs).
inline constexpr int64_t kMaxImageSide = 8192;

/// Reads a PNG or JPEG file (recognised by its first bytes, not its name) as uint8 [C, H, W]:
/// C = 1 for grey images, 3 for colour ones. Alpha is composited on black and dropped; palettes
/// and 16-bit PNGs become 8-bit; CMYK JPEGs are refused. Throws ImageError naming the file.
torch::Tensor read_image(const std::string& path);

/// Whether the name ends in .png, .jpg or .jpeg (any case): what an image folder counts as an image.
bool has_image_extension(const std::string& path);

/// Writes uint8 [C, H, W] (C = 1 or 3) as an 8-bit PNG. Throws ImageError naming the file.
void write_image_png(const std::string& path, const torch::Tensor& image);

/// Writes uint8 [C, H, W] (C = 1 or 3) as a baseline JPEG of the given quality (1..100).
void write_image_jpeg(const std::string& path, const torch::Tensor& image, int quality = 95);

/// How an image whose size differs from the model's becomes S x S.
enum class Fit {
  kResize,  // bilinear resize to S x S (the aspect ratio is not kept)
  kPad,     // centred on a black S x S canvas; a side longer than S is centre-cropped
};

/// "resize" | "pad" -> Fit; std::invalid_argument naming the option otherwise.
Fit parse_fit(const std::string& name);
std::string fit_name(Fit fit);

/// image: uint8 [C, H, W] -> uint8 [C, side, side]. Returned as is when already that size.
torch::Tensor fit_image(const torch::Tensor& image, int64_t side, Fit fit);

/// image: uint8 [C, H, W] with C = 1 or 3 -> uint8 [channels, H, W]: grey is repeated into three
/// channels; colour becomes grey with the ITU-R BT.601 weights (0.299, 0.587, 0.114).
torch::Tensor convert_channels(const torch::Tensor& image, int64_t channels);

}  // namespace capsnet::data
