#include "capsnet/data/segmentation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

namespace capsnet::data {
namespace {

// Independent hash streams per purpose: changing how noise is drawn never moves a digit.
enum Purpose : uint64_t { kMain = 1, kPlace = 2, kFragment = 3, kNoise = 4 };

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// A small counter-based stream: value k of (seed, n, purpose) is mix64(key + k). Own generator so the
/// data are identical across standard libraries (std::normal_distribution is implementation-defined).
class Stream {
 public:
  Stream(uint64_t seed, uint64_t n, uint64_t purpose) : key_(mix64(mix64(mix64(seed) ^ n) ^ purpose)) {}
  uint64_t next() { return mix64(key_ + counter_++); }
  /// Uniform integer in [lo, hi].
  int64_t uniform_int(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  /// Uniform in (0, 1).
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  /// Standard normal (Box-Muller, one value per call).
  double normal() { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()); }

 private:
  uint64_t key_, counter_ = 0;
};

}  // namespace

void DigitSegmentationOptions::validate(int64_t source_side) const {
  auto fail = [](const std::string& m) { throw std::invalid_argument("DigitSegmentationOptions: " + m); };
  if (canvas < source_side)
    fail(fmt::format("canvas ({}) must be at least the source digit side ({})", canvas, source_side));
  if (fragments < 0) fail(fmt::format("fragments must be >= 0, got {}", fragments));
  if (fragment_min < 1 || fragment_max < fragment_min || fragment_max > source_side)
    fail(fmt::format("need 1 <= fragment_min <= fragment_max <= {} (source side), got fragment_min {} and "
                     "fragment_max {}",
                     source_side, fragment_min, fragment_max));
  if (!(noise_std >= 0) || !std::isfinite(noise_std)) fail(fmt::format("noise_std must be >= 0, got {}", noise_std));
  if (!(mask_threshold >= 0 && mask_threshold < 1))
    fail(fmt::format("mask_threshold must be in [0, 1), got {}", mask_threshold));
}

DigitSegmentation::DigitSegmentation(ImageSet source, uint64_t seed, DigitSegmentationOptions options)
    : source_(std::move(source)), seed_(seed), options_(options) {
  if (!source_.images.defined() || source_.images.dim() != 3 || source_.images.size(1) != source_.images.size(2))
    throw std::invalid_argument("DigitSegmentation: source images must be [N, h, h]");
  if (source_.images.scalar_type() != torch::kUInt8)
    throw std::invalid_argument("DigitSegmentation: source images must be uint8");
  if (source_.images.size(0) < 2)
    throw std::invalid_argument(
        fmt::format("DigitSegmentation: need at least 2 source digits, got {}", source_.images.size(0)));
  if (!source_.labels.defined() || source_.labels.dim() != 1 || source_.labels.size(0) != source_.images.size(0))
    throw std::invalid_argument("DigitSegmentation: source labels must be [N] with N = number of images");
  side_ = source_.images.size(1);
  options_.validate(side_);
  source_.images = source_.images.contiguous();
  source_.labels = source_.labels.to(torch::kLong).contiguous();
}

void DigitSegmentation::render(int64_t n, float* image, float* mask, int64_t* label) const {
  const int64_t S = options_.canvas, h = side_, N = source_.size();
  const uint8_t* src = source_.images.data_ptr<uint8_t>();
  std::vector<float> main(static_cast<size_t>(S * S), 0.f), clutter(static_cast<size_t>(S * S), 0.f);

  Stream pick(seed_, static_cast<uint64_t>(n), kMain);
  const int64_t main_index = pick.uniform_int(0, N - 1);
  *label = source_.labels.data_ptr<int64_t>()[main_index];
  Stream place(seed_, static_cast<uint64_t>(n), kPlace);
  const int64_t oy = place.uniform_int(0, S - h), ox = place.uniform_int(0, S - h);
  const uint8_t* digit = src + main_index * h * h;
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < h; ++x) main[static_cast<size_t>((oy + y) * S + ox + x)] = digit[y * h + x] / 255.f;

  Stream frag(seed_, static_cast<uint64_t>(n), kFragment);
  std::vector<int64_t> ink;
  for (int64_t f = 0; f < options_.fragments; ++f) {
    int64_t other = frag.uniform_int(0, N - 2);
    if (other >= main_index) ++other;  // never the main digit itself
    const uint8_t* o = src + other * h * h;
    const int64_t c = frag.uniform_int(options_.fragment_min, options_.fragment_max);
    ink.clear();
    for (int64_t k = 0; k < h * h; ++k)
      if (o[k] > 127) ink.push_back(k);
    // Centre the crop on a random stroke pixel so that the fragment carries ink, not background.
    const int64_t centre = ink.empty() ? (h / 2) * h + h / 2 : ink[static_cast<size_t>(frag.uniform_int(0, static_cast<int64_t>(ink.size()) - 1))];
    const int64_t cy = std::clamp<int64_t>(centre / h - c / 2, 0, h - c), cx = std::clamp<int64_t>(centre % h - c / 2, 0, h - c);
    const int64_t py = frag.uniform_int(0, S - c), px = frag.uniform_int(0, S - c);
    for (int64_t y = 0; y < c; ++y)
      for (int64_t x = 0; x < c; ++x) {
        float& dst = clutter[static_cast<size_t>((py + y) * S + px + x)];
        dst = std::max(dst, o[(cy + y) * h + cx + x] / 255.f);
      }
  }

  Stream noise(seed_, static_cast<uint64_t>(n), kNoise);
  const float threshold = static_cast<float>(options_.mask_threshold);
  for (int64_t k = 0; k < S * S; ++k) {
    const auto i = static_cast<size_t>(k);
    const double value = std::max(main[i], clutter[i]) + (options_.noise_std > 0 ? options_.noise_std * noise.normal() : 0.0);
    image[k] = static_cast<float>(std::clamp(value, 0.0, 1.0));
    mask[k] = main[i] > threshold ? 1.f : 0.f;
  }
}

SegmentationBatch DigitSegmentation::generate(int64_t first_n, int64_t count) const {
  if (first_n < 0) throw std::invalid_argument(fmt::format("DigitSegmentation::generate: first_n must be >= 0, got {}", first_n));
  if (count < 1) throw std::invalid_argument(fmt::format("DigitSegmentation::generate: count must be >= 1, got {}", count));
  const int64_t S = options_.canvas;
  SegmentationBatch b;
  b.images = torch::empty({count, 1, S, S}, torch::kFloat);
  b.masks = torch::empty({count, 1, S, S}, torch::kFloat);
  b.labels = torch::empty({count}, torch::kLong);
  float* im = b.images.data_ptr<float>();
  float* ma = b.masks.data_ptr<float>();
  int64_t* la = b.labels.data_ptr<int64_t>();
  for (int64_t k = 0; k < count; ++k) render(first_n + k, im + k * S * S, ma + k * S * S, la + k);
  return b;
}

double foreground_weight(const DigitSegmentation& set, int64_t count) {
  if (count < 1) throw std::invalid_argument(fmt::format("foreground_weight: count must be >= 1, got {}", count));
  constexpr int64_t kChunk = 1000;
  double foreground = 0, background = 0;
  for (int64_t first = 0; first < count; first += kChunk) {
    const auto masks = set.generate(first, std::min(kChunk, count - first)).masks.flatten(1) > 0.5;  // [n, S*S]
    const auto per_image = masks.sum(1).to(torch::kFloat64);                                         // [n]
    const auto has = per_image > 0;
    const double fg = per_image.masked_select(has).sum().item<double>();
    foreground += fg;
    background += has.sum().item<double>() * static_cast<double>(masks.size(1)) - fg;
  }
  return foreground > 0 ? background / foreground : 1.0;
}

torch::Tensor dice_per_image(const torch::Tensor& predicted, const torch::Tensor& target) {
  if (!predicted.defined() || !target.defined() || predicted.sizes() != target.sizes() || predicted.dim() < 1)
    throw std::invalid_argument("dice_per_image: predicted and target must be defined tensors of the same shape [B, ...]");
  const int64_t B = predicted.size(0);
  auto p = (predicted.reshape({B, -1}) > 0.5).to(torch::kDouble);
  auto t = (target.reshape({B, -1}) > 0.5).to(torch::kDouble);
  auto inter = (p * t).sum(1), total = p.sum(1) + t.sum(1);
  return torch::where(total > 0, 2 * inter / total.clamp_min(1), torch::ones_like(total));
}

}  // namespace capsnet::data
