#include "capsnet/viz/png.h"

#include <fmt/format.h>
#include <png.h>

#include <cstring>
#include <filesystem>

namespace capsnet::viz {

torch::Tensor read_png_gray(const std::string& path) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&image, path.c_str()))
    throw PngError(fmt::format("{}: cannot read PNG: {}", path, image.message));
  if (image.width == 0 || image.height == 0 || image.width > 4096 || image.height > 4096) {
    png_image_free(&image);
    throw PngError(fmt::format("{}: unsupported PNG size {}x{} (at most 4096x4096)", path, image.width,
                               image.height));
  }
  image.format = PNG_FORMAT_GRAY;
  auto out = torch::empty({image.height, image.width}, torch::kUInt8);
  png_color black{0, 0, 0};
  if (!png_image_finish_read(&image, &black, out.data_ptr<uint8_t>(), 0, nullptr)) {
    std::string msg = image.message;
    png_image_free(&image);
    throw PngError(fmt::format("{}: corrupt PNG: {}", path, msg));
  }
  return out;
}

void write_png_gray(const std::string& path, const torch::Tensor& image) {
  TORCH_CHECK(image.dim() == 2, "write_png_gray: image must be [H, W], got ", image.sizes());
  auto pixels = image.scalar_type() == torch::kUInt8
                    ? image.contiguous()
                    : (image.to(torch::kFloat).clamp(0, 1) * 255).round().to(torch::kUInt8).contiguous();
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  png_image png;
  std::memset(&png, 0, sizeof png);
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(pixels.size(1));
  png.height = static_cast<png_uint_32>(pixels.size(0));
  png.format = PNG_FORMAT_GRAY;
  if (!png_image_write_to_file(&png, path.c_str(), 0, pixels.data_ptr<uint8_t>(), 0, nullptr))
    throw PngError(fmt::format("{}: cannot write PNG: {}", path, png.message));
}

}  // namespace capsnet::viz
