#include "capsnet/viz/png.h"

#include "capsnet/data/files.h"
#include "capsnet/data/image_file.h"

#include <fmt/format.h>
#include <png.h>

#include <cstring>
#include <filesystem>

namespace capsnet::viz {

torch::Tensor read_png_gray(const std::string& path) {
  if (const auto why = data::unreadable_reason(path); !why.empty())
    throw PngError(fmt::format("{}: cannot open: {}", path, why));
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
  try {
    data::write_image_png(path, pixels.unsqueeze(0));  // [1, H, W]
  } catch (const data::ImageError& e) {
    throw PngError(e.what());
  }
}

}  // namespace capsnet::viz
