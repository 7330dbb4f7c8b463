#include "capsnet/data/multimnist.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace capsnet::data {
namespace {

// Independent hash streams per purpose, so that e.g. changing how shifts are drawn never changes
// which digits are paired.
enum Purpose : uint64_t { kPermutation = 1, kPartner = 2, kShift = 3 };

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: a bijection with good avalanche
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t hash3(uint64_t seed, uint64_t n, uint64_t purpose) { return mix64(mix64(mix64(seed) ^ n) ^ purpose); }

/// Bijection of [0, n): a balanced 4-round Feistel network on the smallest even-bit power of two >= n,
/// with cycle walking (re-encrypt until the value lands in [0, n)). Expected < 4 passes since the
/// domain is < 4n. Stateless, so no permutation of 60K entries is stored or rebuilt per round.
int64_t permute(int64_t i, int64_t n, uint64_t key) {
  int half = 1;
  while ((uint64_t{1} << (2 * half)) < static_cast<uint64_t>(n)) ++half;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = static_cast<uint64_t>(i);
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = mix64(key ^ mix64((right << 2) | round)) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(x);
}

struct Box {
  int64_t y0 = 0, x0 = 0, y1 = -1, x1 = -1;  // inclusive; empty when y1 < y0
  bool empty() const { return y1 < y0; }
  int64_t area() const { return empty() ? 0 : (y1 - y0 + 1) * (x1 - x0 + 1); }
};

Box ink_box(const float* p, int64_t H, int64_t W) {
  Box b{H, W, -1, -1};
  for (int64_t y = 0; y < H; ++y)
    for (int64_t x = 0; x < W; ++x)
      if (p[y * W + x] > 0) {
        b.y0 = std::min(b.y0, y);
        b.y1 = std::max(b.y1, y);
        b.x0 = std::min(b.x0, x);
        b.x1 = std::max(b.x1, x);
      }
  if (b.y1 < 0) return Box{};
  return b;
}

BoxOverlap overlap_of(const Box& a, const Box& b) {
  BoxOverlap o;
  if (a.empty() || b.empty()) return o;
  const int64_t h = std::min(a.y1, b.y1) - std::max(a.y0, b.y0) + 1;
  const int64_t w = std::min(a.x1, b.x1) - std::max(a.x0, b.x0) + 1;
  const double inter = h > 0 && w > 0 ? static_cast<double>(h * w) : 0.0;
  const double area_a = static_cast<double>(a.area()), area_b = static_cast<double>(b.area());
  o.iou = inter / (area_a + area_b - inter);
  o.over_smaller = inter / std::min(area_a, area_b);
  o.valid = true;
  return o;
}

}  // namespace

const char* overlay_name(Overlay overlay) {
  switch (overlay) {
    case Overlay::kAddClip: return "add";
    case Overlay::kMax: return "max";
  }
  throw std::invalid_argument(fmt::format("MultiMnist: unknown overlay {}", static_cast<int>(overlay)));
}

Overlay parse_overlay(const std::string& name) {
  if (name == "add") return Overlay::kAddClip;
  if (name == "max") return Overlay::kMax;
  throw std::invalid_argument(fmt::format("MultiMnist: overlay must be 'add' or 'max', got '{}'", name));
}

MultiMnist::MultiMnist(ImageSet source, uint64_t seed, MultiMnistOptions options)
    : source_(std::move(source)), seed_(seed), options_(options) {
  const auto& images = source_.images;
  const auto& labels = source_.labels;
  if (!images.defined() || images.dim() != 3 || images.scalar_type() != torch::kUInt8 ||
      images.size(1) != images.size(2))
    throw std::invalid_argument(
        fmt::format("MultiMnist: source images must be square uint8 [N, H, H], got {} {}",
                    images.defined() ? std::string(c10::toString(images.scalar_type())) : "undefined",
                    images.defined() ? c10::str(images.sizes()) : "[]"));
  if (!labels.defined() || labels.dim() != 1 || labels.size(0) != images.size(0))
    throw std::invalid_argument(fmt::format("MultiMnist: source labels must be [N] with N = {}, got {}",
                                            images.size(0), labels.defined() ? c10::str(labels.sizes()) : "[]"));
  if (options_.pad < 0) throw std::invalid_argument(fmt::format("MultiMnist: pad must be >= 0, got {}", options_.pad));
  if (options_.max_shift < 0 || options_.max_shift > options_.pad)
    throw std::invalid_argument(fmt::format(
        "MultiMnist: max_shift must be in [0, pad = {}] so that no ink leaves the canvas, got {}", options_.pad,
        options_.max_shift));
  static_cast<void>(overlay_name(options_.overlay));  // throws for a value outside the enum
  source_.images = images.contiguous();
  source_.labels = labels.to(torch::kLong).contiguous();
  side_ = images.size(1);
  const int64_t n = source_.size();

  const int64_t* lab = source_.labels.data_ptr<int64_t>();
  int64_t num_classes = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (lab[i] < 0) throw std::invalid_argument(fmt::format("MultiMnist: label {} of example {} is negative", lab[i], i));
    num_classes = std::max(num_classes, lab[i] + 1);
  }
  by_class_.resize(static_cast<size_t>(n));
  std::iota(by_class_.begin(), by_class_.end(), int64_t{0});
  std::stable_sort(by_class_.begin(), by_class_.end(), [lab](int64_t x, int64_t y) { return lab[x] < lab[y]; });
  class_begin_.assign(static_cast<size_t>(num_classes + 1), 0);
  for (int64_t i = 0; i < n; ++i) ++class_begin_[static_cast<size_t>(lab[i] + 1)];
  std::partial_sum(class_begin_.begin(), class_begin_.end(), class_begin_.begin());
  int64_t present = 0;
  for (int64_t k = 0; k < num_classes; ++k) present += class_begin_[k + 1] > class_begin_[k];
  if (present < 2)
    throw std::invalid_argument(fmt::format(
        "MultiMnist: the source set needs digits of at least two classes to pair, it has {} ({} examples)", present,
        n));
}

MultiMnist::Choice MultiMnist::choose(int64_t n) const {
  const int64_t N = source_.size();
  const auto un = static_cast<uint64_t>(n);
  Choice c{};
  c.source[0] = permute(n % N, N, hash3(seed_, static_cast<uint64_t>(n / N), kPermutation));
  // Partner: uniform over the digits of every other class = by_class_ with class a's run cut out.
  const int64_t ka = source_.labels.data_ptr<int64_t>()[c.source[0]];
  const int64_t begin = class_begin_[ka], count = class_begin_[ka + 1] - begin;
  const int64_t r = static_cast<int64_t>(hash3(seed_, un, kPartner) % static_cast<uint64_t>(N - count));
  c.source[1] = by_class_[static_cast<size_t>(r < begin ? r : r + count)];
  const auto span = static_cast<uint64_t>(2 * options_.max_shift + 1);
  for (int d = 0; d < 2; ++d) {
    c.dx[d] = static_cast<int64_t>(hash3(seed_, un, kShift + 2 * d) % span) - options_.max_shift;
    c.dy[d] = static_cast<int64_t>(hash3(seed_, un, kShift + 2 * d + 1) % span) - options_.max_shift;
  }
  return c;
}

MultiMnistBatch MultiMnist::generate(int64_t first_n, int64_t count) const {
  if (first_n < 0) throw std::invalid_argument(fmt::format("MultiMnist: example index must be >= 0, got {}", first_n));
  if (count < 1) throw std::invalid_argument(fmt::format("MultiMnist: batch size must be >= 1, got {}", count));
  if (first_n > std::numeric_limits<int64_t>::max() - count)
    throw std::invalid_argument(fmt::format("MultiMnist: examples {} + {} overflow int64", first_n, count));
  const int64_t S = canvas_size(), H = side_;
  MultiMnistBatch batch;
  batch.digits = torch::zeros({count, 2, 1, S, S});  // [B, 2, 1, S, S]
  batch.labels = torch::empty({count, 2}, torch::kLong);
  float* out = batch.digits.data_ptr<float>();
  int64_t* lab_out = batch.labels.data_ptr<int64_t>();
  const uint8_t* src = source_.images.data_ptr<uint8_t>();
  const int64_t* lab = source_.labels.data_ptr<int64_t>();
  for (int64_t b = 0; b < count; ++b) {
    const auto c = choose(first_n + b);
    for (int d = 0; d < 2; ++d) {
      lab_out[2 * b + d] = lab[c.source[d]];
      // Source pixel (y, x) lands at (pad + dy + y, pad + dx + x); |dx|, |dy| <= pad keeps it inside.
      const uint8_t* digit = src + c.source[d] * H * H;
      float* canvas = out + (2 * b + d) * S * S + (options_.pad + c.dy[d]) * S + (options_.pad + c.dx[d]);
      for (int64_t y = 0; y < H; ++y)
        for (int64_t x = 0; x < H; ++x) canvas[y * S + x] = static_cast<float>(digit[y * H + x]) / 255.0f;
    }
  }
  // images: [B, 1, S, S]. add: min(a + b, 1), the authors' uint8 add-and-clip at 255 on [0, 1] floats.
  batch.images = options_.overlay == Overlay::kMax ? std::get<0>(batch.digits.max(1))
                                                   : batch.digits.sum(1).clamp_max_(1.0f);
  return batch;
}

MultiMnistExample MultiMnist::example(int64_t n) const {
  auto batch = generate(n, 1);
  const auto c = choose(n);
  MultiMnistExample e;
  e.image = batch.images[0][0];          // [S, S]
  e.digits = batch.digits[0].squeeze(1);  // [2, S, S]
  e.labels = {batch.labels[0][0].item<int64_t>(), batch.labels[0][1].item<int64_t>()};
  e.source = c.source;
  e.dx = c.dx;
  e.dy = c.dy;
  return e;
}

BoxOverlap box_overlap(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "box_overlap: expected two [H, W] images, got ", a.sizes(), " and ",
              b.sizes());
  auto fa = a.to(torch::kFloat).contiguous(), fb = b.to(torch::kFloat).contiguous();
  return overlap_of(ink_box(fa.data_ptr<float>(), fa.size(0), fa.size(1)),
                    ink_box(fb.data_ptr<float>(), fb.size(0), fb.size(1)));
}

void accumulate_overlap(OverlapStats& stats, const torch::Tensor& digits) {
  TORCH_CHECK((digits.dim() == 5 && digits.size(1) == 2 && digits.size(2) == 1) ||
                  (digits.dim() == 4 && digits.size(1) == 2),
              "accumulate_overlap: digits must be [B, 2, 1, S, S] or [B, 2, S, S], got ", digits.sizes());
  auto d = digits.to(torch::kFloat).contiguous();
  const int64_t B = d.size(0), H = d.size(-2), W = d.size(-1);
  const float* p = d.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const auto o = overlap_of(ink_box(p + (2 * b) * H * W, H, W), ink_box(p + (2 * b + 1) * H * W, H, W));
    if (!o.valid) continue;
    ++stats.examples;
    stats.sum_iou += o.iou;
    stats.sum_over_smaller += o.over_smaller;
  }
}

OverlapStats overlap_stats(const MultiMnist& generator, int64_t first_n, int64_t count, int64_t batch_size) {
  if (count < 1 || batch_size < 1)
    throw std::invalid_argument(
        fmt::format("overlap_stats: count and batch size must be >= 1, got {} and {}", count, batch_size));
  OverlapStats stats;
  for (int64_t done = 0; done < count; done += batch_size)
    accumulate_overlap(stats, generator.generate(first_n + done, std::min(batch_size, count - done)).digits);
  return stats;
}

}  // namespace capsnet::data
