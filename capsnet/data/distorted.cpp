#include "capsnet/data/distorted.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "capsnet/data/transforms.h"

namespace capsnet::data {
namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform numbers for example n: the k-th number is a hash of (seed, n, k) alone. A separate
// `purpose` keeps the source-index draw independent of the distortion draws.
double uniform01(uint64_t seed, int64_t n, uint64_t purpose, uint64_t k) {
  const uint64_t h = splitmix(splitmix(splitmix(seed ^ 0xD157u) ^ static_cast<uint64_t>(n)) ^ (purpose << 32 | k));
  return static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1), 53 bits
}

void check_source(const ImageSet& source, const char* who) {
  if (!source.images.defined() || source.images.dim() != 3 || source.images.scalar_type() != torch::kUInt8)
    throw std::invalid_argument(fmt::format("{}: source images must be uint8 [N, H, W]", who));
  if (!source.labels.defined() || source.labels.dim() != 1 || source.labels.size(0) != source.images.size(0))
    throw std::invalid_argument(fmt::format("{}: source labels must be [N] with N = {}", who, source.images.size(0)));
  if (source.size() == 0) throw std::invalid_argument(fmt::format("{}: the source set is empty", who));
}

// images: [B, H, W] uint8 with one distortion per image -> [B, 1, canvas, canvas] float in [0, 1].
torch::Tensor warp_all(const torch::Tensor& images, const std::vector<AffineParams>& params, int64_t canvas) {
  const int64_t B = images.size(0), H = images.size(1), W = images.size(2);
  auto maps = torch::empty({B, 2, 3}, torch::kDouble);  // forward maps: [B, 2, 3]
  auto m = maps.accessor<double, 3>();
  for (int64_t i = 0; i < B; ++i) {
    const auto A = affine_matrix(params[static_cast<size_t>(i)], H, W, canvas, canvas);
    for (int r = 0; r < 2; ++r)
      for (int k = 0; k < 3; ++k) m[i][r][k] = A[static_cast<size_t>(3 * r + k)];
  }
  // Bilinear weights sum to at most 1, so [0, 1] stays [0, 1] up to rounding.
  return warp_affine(to_float(images), maps, canvas, canvas).clamp_(0, 1);
}

}  // namespace

void DistortionRanges::validate() const {
  if (!(max_rotation_deg >= 0 && max_rotation_deg <= 180))
    throw std::invalid_argument(fmt::format("distortion ranges: max_rotation_deg must be in [0, 180], got {}",
                                            max_rotation_deg));
  if (!(min_scale > 0 && min_scale <= max_scale && std::isfinite(max_scale)))
    throw std::invalid_argument(fmt::format(
        "distortion ranges: scales must satisfy 0 < min_scale <= max_scale, got [{}, {}]", min_scale, max_scale));
}

AffineParams draw_distortion(uint64_t seed, int64_t n, const BoundingBox& box_in, int64_t src_h, int64_t src_w,
                             int64_t canvas, const DistortionRanges& ranges) {
  ranges.validate();
  if (canvas <= 0) throw std::invalid_argument(fmt::format("draw_distortion: canvas must be positive, got {}", canvas));
  if (src_h <= 0 || src_w <= 0)
    throw std::invalid_argument(fmt::format("draw_distortion: source size must be positive, got {}x{}", src_h, src_w));
  AffineParams p;
  p.rotation_deg = -ranges.max_rotation_deg + 2 * ranges.max_rotation_deg * uniform01(seed, n, 1, 0);
  p.scale_x = p.scale_y = ranges.min_scale + (ranges.max_scale - ranges.min_scale) * uniform01(seed, n, 1, 1);
  BoundingBox box = box_in;
  if (box.empty()) box = BoundingBox{0, 0, src_w - 1, src_h - 1};
  place_inside_canvas(p, box, src_h, src_w, canvas, uniform01(seed, n, 1, 2), uniform01(seed, n, 1, 3));
  return p;
}

int64_t distorted_source_index(uint64_t seed, int64_t n, int64_t num_source) {
  if (num_source <= 0)
    throw std::invalid_argument(fmt::format("distorted_source_index: num_source must be positive, got {}", num_source));
  const auto k = static_cast<int64_t>(uniform01(seed, n, 2, 0) * static_cast<double>(num_source));
  return std::min(k, num_source - 1);
}

DistortedBatch distorted_batch(const ImageSet& source, uint64_t seed, int64_t first, int64_t count, int64_t canvas,
                               const DistortionRanges& ranges) {
  check_source(source, "distorted_batch");
  if (first < 0) throw std::invalid_argument(fmt::format("distorted_batch: first must be >= 0, got {}", first));
  if (count <= 0) throw std::invalid_argument(fmt::format("distorted_batch: count must be positive, got {}", count));
  const int64_t H = source.images.size(1), W = source.images.size(2);
  DistortedBatch b;
  b.source_index = torch::empty({count}, torch::kLong);
  auto idx = b.source_index.accessor<int64_t, 1>();
  for (int64_t i = 0; i < count; ++i) idx[i] = distorted_source_index(seed, first + i, source.size());
  const auto images = source.images.index_select(0, b.source_index).contiguous();  // [B, H, W] uint8
  b.labels = source.labels.index_select(0, b.source_index);
  for (int64_t i = 0; i < count; ++i)
    b.params.push_back(draw_distortion(seed, first + i, bounding_box(images[i]), H, W, canvas, ranges));
  b.images = warp_all(images, b.params, canvas);  // [B, 1, canvas, canvas]
  return b;
}

ImageSet distorted_set(const ImageSet& source, uint64_t seed, int64_t canvas, const DistortionRanges& ranges) {
  check_source(source, "distorted_set");
  const int64_t N = source.size(), H = source.images.size(1), W = source.images.size(2);
  ImageSet out;
  out.labels = source.labels.clone();
  out.images = torch::empty({N, canvas, canvas}, torch::kUInt8);
  constexpr int64_t kChunk = 500;  // bounds warp_affine's float64 temporaries
  for (int64_t start = 0; start < N; start += kChunk) {
    const int64_t len = std::min(kChunk, N - start);
    const auto chunk = source.images.narrow(0, start, len).contiguous();  // [len, H, W]
    std::vector<AffineParams> params;
    for (int64_t i = 0; i < len; ++i)
      params.push_back(draw_distortion(seed, start + i, bounding_box(chunk[i]), H, W, canvas, ranges));
    out.images.narrow(0, start, len)
        .copy_(warp_all(chunk, params, canvas).squeeze(1).mul(255).round_().to(torch::kUInt8));
  }
  return out;
}

}  // namespace capsnet::data
