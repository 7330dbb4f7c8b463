#include "capsnet/data/affine.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "capsnet/data/transforms.h"

namespace capsnet::data {
namespace {

constexpr double kPi = 3.14159265358979323846;

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

/// A tiny counter-based stream: the same numbers on every platform and LibTorch version (torch's
/// generators and std:: distributions promise neither), so a seed names the same test set forever.
class Stream {
 public:
  Stream(uint64_t seed, uint64_t index) : state_(mix64(seed * 0x9E3779B97F4A7C15ull + 0xA5) ^ mix64(index + 1)) {}
  /// Uniform in [0, 1) with 53 random bits.
  double uniform() {
    state_ += 0x9E3779B97F4A7C15ull;
    return static_cast<double>(mix64(state_) >> 11) * 0x1.0p-53;
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

 private:
  uint64_t state_;
};

/// Bounding box of the pixels > 0 of one [H, W] uint8 mask given by accessor.
BoundingBox box_of(const at::TensorAccessor<uint8_t, 2>& m) {
  BoundingBox b;
  const int64_t H = m.size(0), W = m.size(1);
  b.x0 = W, b.y0 = H;
  for (int64_t y = 0; y < H; ++y)
    for (int64_t x = 0; x < W; ++x)
      if (m[y][x]) {
        b.x0 = std::min(b.x0, x), b.x1 = std::max(b.x1, x);
        b.y0 = std::min(b.y0, y), b.y1 = std::max(b.y1, y);
      }
  if (b.x1 < 0) b = BoundingBox{};
  return b;
}

void check_uint8_set(const ImageSet& source, const char* who) {
  TORCH_CHECK(source.images.defined() && source.images.dim() == 3 && source.images.scalar_type() == torch::kUInt8,
              who, ": source images must be uint8 [N, H, W], got ",
              source.images.defined() ? source.images.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(source.labels.defined() && source.labels.dim() == 1 && source.labels.size(0) == source.images.size(0),
              who, ": labels must be [N] with N = ", source.images.size(0));
}

torch::Tensor to_uint8(const torch::Tensor& images01) {  // [B, 1, H, W] in [0, 1] -> [B, H, W] uint8
  return images01.squeeze(1).mul(255).round_().clamp_(0, 255).to(torch::kUInt8);
}

constexpr int64_t kChunk = 500;  // images per warp: bounds the [B, out_h * out_w] float64 temporaries

}  // namespace

torch::Tensor place_in_canvas(const torch::Tensor& images, int64_t canvas, int64_t max_shift, at::Generator& gen) {
  TORCH_CHECK(images.dim() == 4, "place_in_canvas: images must be [B, C, H, W], got ", images.sizes());
  const int64_t H = images.size(2), W = images.size(3);
  TORCH_CHECK(canvas >= H && canvas >= W, "place_in_canvas: canvas ", canvas, " is smaller than the ", H, "x", W,
              " images");
  const int64_t border = std::min((canvas - H) / 2, (canvas - W) / 2);
  TORCH_CHECK(max_shift >= 0 && max_shift <= border, "place_in_canvas: max_shift must be in [0, ", border,
              "] so that a ", H, "x", W, " image stays inside a ", canvas, "x", canvas, " canvas, got ", max_shift);
  const int64_t top = (canvas - H) / 2, left = (canvas - W) / 2;
  // The padding is at least max_shift wide on every side, so the shift below never crops the image.
  auto centred = torch::constant_pad_nd(images, {left, canvas - W - left, top, canvas - H - top}, 0);
  return random_shift(centred, max_shift, gen);  // [B, C, canvas, canvas]
}

void AffineRanges::validate() const {
  auto fail = [](const std::string& msg) { throw std::invalid_argument("affine ranges: " + msg); };
  if (!(max_rotation_deg >= 0 && max_rotation_deg <= 180))
    fail(fmt::format("max_rotation_deg must be in [0, 180], got {}", max_rotation_deg));
  if (!(max_shear >= 0 && max_shear < 1)) fail(fmt::format("max_shear must be in [0, 1), got {}", max_shear));
  if (!(min_scale > 0 && min_scale <= max_scale && std::isfinite(max_scale)))
    fail(fmt::format("scales must satisfy 0 < min_scale <= max_scale, got [{}, {}]", min_scale, max_scale));
}

std::array<double, 6> affine_matrix(const AffineParams& p, int64_t src_h, int64_t src_w, int64_t out_h,
                                    int64_t out_w) {
  if (src_h <= 0 || src_w <= 0 || out_h <= 0 || out_w <= 0)
    throw std::invalid_argument(
        fmt::format("affine_matrix: sizes must be positive, got source {}x{} and output {}x{}", src_h, src_w, out_h,
                    out_w));
  // Linear part L = R * Sh * S with R = [[cos, sin], [-sin, cos]]: counter-clockwise on screen because
  // y points down; Sh = [[1, k], [0, 1]]; S = diag(sx, sy).
  const double th = p.rotation_deg * kPi / 180, c = std::cos(th), s = std::sin(th);
  const double sx = p.scale_x, sy = p.scale_y, k = p.shear;
  const double a = c * sx, b = (c * k + s) * sy;
  const double d = -s * sx, e = (-s * k + c) * sy;
  // Centre of a pixel grid of n pixels is (n - 1) / 2; the source centre goes to canvas centre + t.
  const double cix = (src_w - 1) / 2.0, ciy = (src_h - 1) / 2.0;
  const double cox = (out_w - 1) / 2.0 + p.tx, coy = (out_h - 1) / 2.0 + p.ty;
  return {a, b, cox - a * cix - b * ciy, d, e, coy - d * cix - e * ciy};
}

torch::Tensor warp_affine(const torch::Tensor& images, const torch::Tensor& forward, int64_t out_h, int64_t out_w) {
  TORCH_CHECK(images.dim() == 4 && images.is_floating_point(),
              "warp_affine: images must be floating point [B, C, H, W], got ", images.scalar_type(), " ",
              images.sizes());
  const int64_t B = images.size(0), C = images.size(1), H = images.size(2), W = images.size(3);
  TORCH_CHECK(forward.dim() == 3 && forward.size(0) == B && forward.size(1) == 2 && forward.size(2) == 3,
              "warp_affine: forward maps must be [B, 2, 3] with B = ", B, ", got ", forward.sizes());
  TORCH_CHECK(out_h > 0 && out_w > 0, "warp_affine: output size must be positive, got ", out_h, "x", out_w);
  const auto dopt = torch::TensorOptions().dtype(torch::kDouble).device(images.device());
  const auto m = forward.to(dopt);
  const auto a = m.select(1, 0).select(1, 0).unsqueeze(1), b = m.select(1, 0).select(1, 1).unsqueeze(1),
             e = m.select(1, 0).select(1, 2).unsqueeze(1);  // [B, 1]
  const auto c = m.select(1, 1).select(1, 0).unsqueeze(1), d = m.select(1, 1).select(1, 1).unsqueeze(1),
             f = m.select(1, 1).select(1, 2).unsqueeze(1);  // [B, 1]
  const auto det = a * d - b * c;                            // [B, 1]
  const auto singular = det.abs().lt(1e-12).squeeze(1);
  TORCH_CHECK(!singular.any().item<bool>(), "warp_affine: map ", singular.nonzero()[0].item<int64_t>(),
              " is singular (determinant ", det.abs().min().item<double>(), ")");

  // Inverse map: output pixel q = (qx, qy) reads the source at A^-1 (q - t).
  const int64_t P = out_h * out_w;
  const auto gx = torch::arange(out_w, dopt).view({1, out_w}).expand({out_h, out_w}).reshape({1, P});  // [1, P]
  const auto gy = torch::arange(out_h, dopt).view({out_h, 1}).expand({out_h, out_w}).reshape({1, P});  // [1, P]
  const auto qx = gx - e, qy = gy - f;                                                   // [B, P]
  const auto src_x = (d * qx - b * qy) / det, src_y = (a * qy - c * qx) / det;           // [B, P]
  const auto x0 = src_x.floor(), y0 = src_y.floor();
  const auto wx = (src_x - x0).to(images.scalar_type()), wy = (src_y - y0).to(images.scalar_type());  // [B, P]
  const auto ix = x0.to(torch::kLong), iy = y0.to(torch::kLong);

  const auto flat = images.reshape({B, C, H * W});
  auto out = torch::zeros({B, C, P}, images.options());
  for (int64_t dy = 0; dy <= 1; ++dy)
    for (int64_t dx = 0; dx <= 1; ++dx) {
      const auto xi = ix + dx, yi = iy + dy;                                       // [B, P]
      const auto valid = (xi >= 0) & (xi < W) & (yi >= 0) & (yi < H);
      const auto index = (yi.clamp(0, H - 1) * W + xi.clamp(0, W - 1)).unsqueeze(1).expand({B, C, P});
      const auto w = (dx ? wx : 1 - wx) * (dy ? wy : 1 - wy) * valid.to(images.scalar_type());  // [B, P]
      out += flat.gather(2, index) * w.unsqueeze(1);
    }
  return out.view({B, C, out_h, out_w});
}

BoundingBox bounding_box(const torch::Tensor& image) {
  TORCH_CHECK(image.dim() == 2, "bounding_box: image must be [H, W], got ", image.sizes());
  const auto mask = image.gt(0).to(torch::kUInt8).cpu().contiguous();
  return box_of(mask.accessor<uint8_t, 2>());
}

void place_inside_canvas(AffineParams& p, const BoundingBox& box, int64_t src_h, int64_t src_w, int64_t canvas,
                         double ux, double uy) {
  // Where the box, grown by the 1 px bilinear footprint, lands with t = 0; then the translations
  // that keep it inside [0, canvas - 1] on both axes: lo + t >= 0 and hi + t <= canvas - 1.
  p.tx = p.ty = 0;
  const auto A = affine_matrix(p, src_h, src_w, canvas, canvas);
  double lo_x = 1e300, hi_x = -1e300, lo_y = 1e300, hi_y = -1e300;
  for (double x : {box.x0 - 1.0, box.x1 + 1.0})
    for (double y : {box.y0 - 1.0, box.y1 + 1.0}) {
      const double qx = A[0] * x + A[1] * y + A[2], qy = A[3] * x + A[4] * y + A[5];
      lo_x = std::min(lo_x, qx), hi_x = std::max(hi_x, qx);
      lo_y = std::min(lo_y, qy), hi_y = std::max(hi_y, qy);
    }
  auto pick = [&](double lo, double hi, double u) {
    const double t_min = -lo, t_max = (canvas - 1) - hi;
    return t_min <= t_max ? t_min + u * (t_max - t_min) : (t_min + t_max) / 2;  // too large: centre it
  };
  p.tx = pick(lo_x, hi_x, ux);
  p.ty = pick(lo_y, hi_y, uy);
}

AffineParams draw_affine_params(uint64_t seed, int64_t index, const BoundingBox& box, int64_t src_h, int64_t src_w,
                                int64_t canvas, const AffineRanges& ranges) {
  ranges.validate();
  if (canvas <= 0) throw std::invalid_argument(fmt::format("draw_affine_params: canvas must be positive, got {}", canvas));
  Stream rng(seed, static_cast<uint64_t>(index));
  AffineParams p;
  p.rotation_deg = rng.uniform(-ranges.max_rotation_deg, ranges.max_rotation_deg);
  p.shear = rng.uniform(-ranges.max_shear, ranges.max_shear);
  p.scale_x = rng.uniform(ranges.min_scale, ranges.max_scale);
  p.scale_y = rng.uniform(ranges.min_scale, ranges.max_scale);
  const double ux = rng.uniform(), uy = rng.uniform();  // always drawn: the stream layout never changes
  if (!box.empty()) place_inside_canvas(p, box, src_h, src_w, canvas, ux, uy);
  return p;
}

ImageSet affine_test_set(const ImageSet& source, uint64_t seed, int64_t canvas, const AffineRanges& ranges) {
  check_uint8_set(source, "affine_test_set");
  ranges.validate();
  const int64_t N = source.size(), H = source.images.size(1), W = source.images.size(2);
  TORCH_CHECK(canvas >= H && canvas >= W, "affine_test_set: canvas ", canvas, " is smaller than the ", H, "x", W,
              " source images");
  ImageSet out;
  out.labels = source.labels.clone();
  out.images = torch::empty({N, canvas, canvas}, torch::kUInt8);
  const auto src = source.images.cpu().contiguous();
  for (int64_t start = 0; start < N; start += kChunk) {
    const int64_t len = std::min(kChunk, N - start);
    const auto chunk = src.narrow(0, start, len);            // [len, H, W] uint8
    const auto mask = chunk.gt(0).to(torch::kUInt8).contiguous();
    const auto m = mask.accessor<uint8_t, 3>();
    auto maps = torch::empty({len, 2, 3}, torch::kDouble);  // forward maps: [len, 2, 3]
    auto mp = maps.accessor<double, 3>();
    for (int64_t i = 0; i < len; ++i) {
      const auto p = draw_affine_params(seed, start + i, box_of(m[i]), H, W, canvas, ranges);
      const auto A = affine_matrix(p, H, W, canvas, canvas);
      for (int r = 0; r < 2; ++r)
        for (int k = 0; k < 3; ++k) mp[i][r][k] = A[3 * r + k];
    }
    out.images.narrow(0, start, len).copy_(to_uint8(warp_affine(to_float(chunk), maps, canvas, canvas)));
  }
  return out;
}

ImageSet translated_set(const ImageSet& source, uint64_t seed, int64_t canvas, int64_t max_shift) {
  check_uint8_set(source, "translated_set");
  const int64_t N = source.size();
  TORCH_CHECK(canvas >= source.images.size(1) && canvas >= source.images.size(2), "translated_set: canvas ", canvas,
              " is smaller than the ", source.images.size(1), "x", source.images.size(2), " source images");
  ImageSet out;
  out.labels = source.labels.clone();
  out.images = torch::empty({N, canvas, canvas}, torch::kUInt8);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int64_t start = 0; start < N; start += kChunk) {
    const int64_t len = std::min(kChunk, N - start);
    auto placed = place_in_canvas(to_float(source.images.narrow(0, start, len)), canvas, max_shift, gen);
    out.images.narrow(0, start, len).copy_(to_uint8(placed));  // k / 255 * 255 rounds back to k exactly
  }
  return out;
}

std::vector<WarpSet> robustness_family() {
  const auto only = [](double rotation, double shear, double min_scale, double max_scale) {
    AffineRanges r;
    r.max_rotation_deg = rotation, r.max_shear = shear, r.min_scale = min_scale, r.max_scale = max_scale;
    return r;
  };
  std::vector<WarpSet> sets = {{"none", "translation only", 0, only(0, 0, 1, 1)}};
  for (double deg : {10, 20, 30, 45})
    sets.push_back({"rotation", fmt::format("rotation ±{:g}°", deg), deg, only(deg, 0, 1, 1)});
  for (double k : {0.1, 0.2, 0.4}) sets.push_back({"shear", fmt::format("shear ±{:g}", k), k, only(0, k, 1, 1)});
  for (double d : {0.2, 0.4})
    sets.push_back({"scale", fmt::format("scale {:g}–{:g} per axis", 1 - d, 1 + d), d, only(0, 0, 1 - d, 1 + d)});
  sets.push_back({"combined", "affNIST-style (±20°, shear ±0.1, scale 0.8–1.2)", 1, AffineRanges{}});
  sets.push_back({"combined", "±20°, shear ±0.2, scale 0.8–1.2", 2, only(20, 0.2, 0.8, 1.2)});
  return sets;
}

}  // namespace capsnet::data
