#include "capsnet/data/image_file.h"

#include "capsnet/data/files.h"

#include <fmt/format.h>
#include <jpeglib.h>
#include <png.h>

#include <algorithm>
#include <cctype>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

namespace capsnet::data {
namespace {

torch::Tensor read_png(const std::string& path) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&image, path.c_str()))
    throw ImageError(fmt::format("{}: cannot read PNG: {}", path, image.message));
  const int64_t H = image.height, W = image.width;
  if (H > kMaxImageSide || W > kMaxImageSide) {
    png_image_free(&image);
    throw ImageError(fmt::format("{}: image of {}x{} is larger than {}x{}", path, W, H, kMaxImageSide, kMaxImageSide));
  }
  const bool colour = (image.format & PNG_FORMAT_FLAG_COLOR) != 0;
  image.format = colour ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;  // no alpha: composited on `black`
  const int64_t C = colour ? 3 : 1;
  auto hwc = torch::empty({H, W, C}, torch::kUInt8);
  png_color black{0, 0, 0};
  if (!png_image_finish_read(&image, &black, hwc.data_ptr<uint8_t>(), 0, nullptr)) {
    std::string msg = image.message;
    png_image_free(&image);
    throw ImageError(fmt::format("{}: corrupt PNG: {}", path, msg));
  }
  return hwc.permute({2, 0, 1}).contiguous();  // [C, H, W]
}

// libjpeg reports errors through a callback that must not return: jump back to read_jpeg.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings (msg_level -1: a truncated file, corrupt data) mean libjpeg made up the missing pixels:
// for training data that is a damaged file, so it is an error too. Trace messages (level >= 0) are ignored.
void jpeg_emit_message(j_common_ptr cinfo, int msg_level) {
  if (msg_level < 0) jpeg_error_exit(cinfo);
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

torch::Tensor read_jpeg(const std::string& path) {
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "rb"));
  if (!file) throw ImageError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_error_exit;
  err.mgr.emit_message = jpeg_emit_message;
  err.message[0] = '\0';
  // Everything setjmp may return into is declared before it (no C++ object is skipped by longjmp).
  torch::Tensor hwc;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw ImageError(fmt::format("{}: corrupt JPEG: {}", path, err.message));
  }
  jpeg_create_decompress(&cinfo);
  jpeg_stdio_src(&cinfo, file.get());
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    jpeg_destroy_decompress(&cinfo);
    throw ImageError(fmt::format("{}: CMYK JPEGs are not supported (convert the file to RGB)", path));
  }
  const bool grey = cinfo.jpeg_color_space == JCS_GRAYSCALE;
  cinfo.out_color_space = grey ? JCS_GRAYSCALE : JCS_RGB;
  if (cinfo.image_width > kMaxImageSide || cinfo.image_height > kMaxImageSide) {
    const auto w = cinfo.image_width, h = cinfo.image_height;
    jpeg_destroy_decompress(&cinfo);
    throw ImageError(fmt::format("{}: image of {}x{} is larger than {}x{}", path, w, h, kMaxImageSide, kMaxImageSide));
  }
  jpeg_start_decompress(&cinfo);
  const int64_t H = cinfo.output_height, W = cinfo.output_width, C = cinfo.output_components;
  hwc = torch::empty({H, W, C}, torch::kUInt8);
  auto* base = hwc.data_ptr<uint8_t>();
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = base + static_cast<int64_t>(cinfo.output_scanline) * W * C;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return hwc.permute({2, 0, 1}).contiguous();  // [C, H, W]
}

}  // namespace

torch::Tensor read_image(const std::string& path) {
  if (const auto why = unreadable_reason(path); !why.empty()) throw ImageError(fmt::format("{}: cannot open: {}", path, why));
  unsigned char magic[8] = {0};
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw ImageError(fmt::format("{}: cannot open", path));
    in.read(reinterpret_cast<char*>(magic), sizeof magic);
    if (in.gcount() < 3) throw ImageError(fmt::format("{}: not an image (file of {} bytes)", path, in.gcount()));
  }
  static const unsigned char png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (std::memcmp(magic, png_sig, 8) == 0) return read_png(path);
  if (magic[0] == 0xFF && magic[1] == 0xD8 && magic[2] == 0xFF) return read_jpeg(path);
  throw ImageError(fmt::format("{}: neither PNG nor JPEG (unrecognised first bytes)", path));
}

bool has_image_extension(const std::string& path) {
  auto ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg";
}

void write_image_png(const std::string& path, const torch::Tensor& image) {
  if (image.dim() != 3 || (image.size(0) != 1 && image.size(0) != 3) || image.scalar_type() != torch::kUInt8)
    throw ImageError(fmt::format("{}: write_image_png needs uint8 [1 or 3, H, W], got {} {}", path,
                                 c10::toString(image.scalar_type()), c10::str(image.sizes())));
  if (const auto why = unwritable_reason(path); !why.empty()) throw ImageError(fmt::format("{}: cannot write: {}", path, why));
  auto hwc = image.permute({1, 2, 0}).contiguous();
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  png_image png;
  std::memset(&png, 0, sizeof png);
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(image.size(2));
  png.height = static_cast<png_uint_32>(image.size(1));
  png.format = image.size(0) == 3 ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  // Through our own FILE: libpng's png_image_write_to_file removes the path after a failed write, which
  // deleted device nodes such as /dev/full. Only a regular file we wrote part of is removed here.
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "wb"));
  if (!file) throw ImageError(fmt::format("{}: cannot write: {}", path, std::strerror(errno)));
  const bool written = png_image_write_to_stdio(&png, file.get(), 0, hwc.data_ptr<uint8_t>(), 0, nullptr) != 0;
  const bool flushed = std::fflush(file.get()) == 0 && !std::ferror(file.get());
  const bool closed = std::fclose(file.release()) == 0;  // a write error may surface only here
  const int saved_errno = errno;
  if (!written || !flushed || !closed) {
    if (!data::exists_but_not_regular(path)) std::filesystem::remove(path);
    throw ImageError(fmt::format("{}: cannot write PNG: {}", path, written ? std::strerror(saved_errno) : png.message));
  }
}

void write_image_jpeg(const std::string& path, const torch::Tensor& image, int quality) {
  if (image.dim() != 3 || (image.size(0) != 1 && image.size(0) != 3) || image.scalar_type() != torch::kUInt8)
    throw ImageError(fmt::format("{}: write_image_jpeg needs uint8 [1 or 3, H, W], got {} {}", path,
                                 c10::toString(image.scalar_type()), c10::str(image.sizes())));
  if (quality < 1 || quality > 100) throw ImageError(fmt::format("{}: JPEG quality must be in [1, 100], got {}", path, quality));
  if (const auto why = unwritable_reason(path); !why.empty()) throw ImageError(fmt::format("{}: cannot write: {}", path, why));
  auto hwc = image.permute({1, 2, 0}).contiguous();
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  std::unique_ptr<std::FILE, FileCloser> file(std::fopen(path.c_str(), "wb"));
  if (!file) throw ImageError(fmt::format("{}: cannot write: {}", path, std::strerror(errno)));
  jpeg_compress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_error_exit;
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    throw ImageError(fmt::format("{}: cannot write JPEG: {}", path, err.message));
  }
  jpeg_create_compress(&cinfo);
  jpeg_stdio_dest(&cinfo, file.get());
  cinfo.image_width = static_cast<JDIMENSION>(image.size(2));
  cinfo.image_height = static_cast<JDIMENSION>(image.size(1));
  cinfo.input_components = static_cast<int>(image.size(0));
  cinfo.in_color_space = image.size(0) == 3 ? JCS_RGB : JCS_GRAYSCALE;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  auto* base = hwc.data_ptr<uint8_t>();
  const int64_t stride = image.size(2) * image.size(0);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = base + static_cast<int64_t>(cinfo.next_scanline) * stride;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
}

Fit parse_fit(const std::string& name) {
  if (name == "resize") return Fit::kResize;
  if (name == "pad") return Fit::kPad;
  throw std::invalid_argument(fmt::format("fit must be resize or pad, got '{}'", name));
}

std::string fit_name(Fit fit) { return fit == Fit::kResize ? "resize" : "pad"; }

torch::Tensor fit_image(const torch::Tensor& image, int64_t side, Fit fit) {
  TORCH_CHECK(image.dim() == 3 && image.scalar_type() == torch::kUInt8, "fit_image: expected uint8 [C, H, W], got ",
              image.scalar_type(), " ", image.sizes());
  TORCH_CHECK(side > 0, "fit_image: side must be positive, got ", side);
  const int64_t C = image.size(0), H = image.size(1), W = image.size(2);
  if (H == side && W == side) return image;
  if (fit == Fit::kResize) {
    namespace F = torch::nn::functional;
    auto f = F::interpolate(image.to(torch::kFloat).unsqueeze(0),
                            F::InterpolateFuncOptions()
                                .size(std::vector<int64_t>{side, side})
                                .mode(torch::kBilinear)
                                .align_corners(false));
    return f.squeeze(0).round_().clamp_(0, 255).to(torch::kUInt8);
  }
  // Pad (or centre-crop) each axis independently: the overlap of the centred image and the canvas.
  auto out = torch::zeros({C, side, side}, torch::kUInt8);
  const int64_t copy_h = std::min(H, side), copy_w = std::min(W, side);
  const int64_t src_y = (H - copy_h) / 2, src_x = (W - copy_w) / 2;
  const int64_t dst_y = (side - copy_h) / 2, dst_x = (side - copy_w) / 2;
  out.narrow(1, dst_y, copy_h).narrow(2, dst_x, copy_w).copy_(image.narrow(1, src_y, copy_h).narrow(2, src_x, copy_w));
  return out;
}

torch::Tensor convert_channels(const torch::Tensor& image, int64_t channels) {
  TORCH_CHECK(image.dim() == 3 && (image.size(0) == 1 || image.size(0) == 3), "convert_channels: expected [1 or 3, H, W], got ",
              image.sizes());
  TORCH_CHECK(channels == 1 || channels == 3, "convert_channels: channels must be 1 or 3, got ", channels);
  if (image.size(0) == channels) return image;
  if (channels == 3) return image.expand({3, image.size(1), image.size(2)}).contiguous();
  auto w = torch::tensor({0.299f, 0.587f, 0.114f}).view({3, 1, 1});
  return (image.to(torch::kFloat) * w).sum(0, true).round_().clamp_(0, 255).to(torch::kUInt8);
}

}  // namespace capsnet::data
