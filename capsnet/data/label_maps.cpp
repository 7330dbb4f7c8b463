#include "capsnet/data/label_maps.h"

#include <fmt/format.h>

#include <stdexcept>

namespace capsnet::data {
namespace {

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

void LabelMapOptions::validate() const {
  if (size < 8 || size > 1024)
    throw std::invalid_argument(fmt::format("LabelMapOptions: size must be in [8, 1024], got {}", size));
  if (!(object_threshold >= 0 && object_threshold < 1))
    throw std::invalid_argument(
        fmt::format("LabelMapOptions: object_threshold must be in [0, 1), got {}", object_threshold));
}

LabelMaps::LabelMaps(ImageSet source, uint64_t seed, LabelMapOptions options)
    : source_(std::move(source)), seed_(seed), options_(options) {
  options_.validate();
  if (!source_.images.defined() || source_.images.dim() != 3 || source_.images.scalar_type() != torch::kUInt8)
    throw std::invalid_argument("LabelMaps: source images must be [N, h, w] uint8");
  if (source_.images.size(0) < 1 || !source_.labels.defined() || source_.labels.size(0) != source_.images.size(0))
    throw std::invalid_argument("LabelMaps: need at least one source image and one label per image");
}

torch::Tensor label_map_of(const torch::Tensor& ink, double object_threshold) {
  auto object = ink > object_threshold;  // [B, 1, S, S] bool
  // Background dilated by one pixel (8-neighbourhood); the canvas border counts as background.
  auto background = (~object).to(torch::kFloat);
  auto padded = torch::constant_pad_nd(background, {1, 1, 1, 1}, 1.0);
  auto near_background = torch::max_pool2d(padded, {3, 3}, {1, 1}) > 0.5;  // [B, 1, S, S]
  auto edge = object & near_background;
  auto maps = object.to(torch::kLong) * kLabelInterior;
  return maps.masked_fill(edge, kLabelEdge);
}

torch::Tensor one_hot_maps(const torch::Tensor& maps, int64_t classes) {
  // [B, 1, S, S] -> [B, S, S, classes] -> [B, classes, S, S]
  return torch::one_hot(maps.squeeze(1), classes).permute({0, 3, 1, 2}).to(torch::kFloat).contiguous();
}

LabelMapBatch LabelMaps::generate(int64_t first_n, int64_t count) const {
  if (first_n < 0 || count < 1)
    throw std::invalid_argument(fmt::format("LabelMaps::generate: need first_n >= 0 and count >= 1, got {} and {}",
                                            first_n, count));
  const int64_t N = source_.size(), S = options_.size;
  std::vector<int64_t> idx(count);
  std::vector<bool> flip(count);
  for (int64_t k = 0; k < count; ++k) {
    const uint64_t h = mix64(mix64(seed_) ^ static_cast<uint64_t>(first_n + k));
    idx[k] = static_cast<int64_t>((h >> 1) % static_cast<uint64_t>(N));
    flip[k] = options_.flip && (h & 1);
  }
  auto ids = torch::tensor(idx, torch::kLong);
  auto ink = source_.images.index_select(0, ids).unsqueeze(1).to(torch::kFloat) / 255;  // [B, 1, h, w]
  ink = torch::upsample_bilinear2d(ink, {S, S}, /*align_corners=*/false).clamp(0, 1);  // [B, 1, S, S]
  for (int64_t k = 0; k < count; ++k)
    if (flip[k]) ink[k].copy_(ink[k].flip({2}));
  LabelMapBatch b;
  b.maps = label_map_of(ink, options_.object_threshold);
  b.one_hot = one_hot_maps(b.maps);
  b.images = ink * 2 - 1;
  b.labels = source_.labels.index_select(0, ids);
  b.sources = ids;
  return b;
}

}  // namespace capsnet::data
