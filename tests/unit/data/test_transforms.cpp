// to_float, shift and random_shift: exact pixel movement, zero padding, seeded determinism, range.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <utility>

#include "capsnet/data/transforms.h"

using capsnet::data::random_hflip;
using capsnet::data::random_shift;
using capsnet::data::shift;
using capsnet::data::to_float;

using torch::indexing::Slice;

namespace {

// Obviously-correct reference: out[b, c, y, x] = in[b, c, y - dy, x - dx] or 0 outside.
torch::Tensor shift_reference(const torch::Tensor& in, const torch::Tensor& dx, const torch::Tensor& dy) {
  auto out = torch::zeros_like(in);
  const int64_t H = in.size(2), W = in.size(3);
  for (int64_t b = 0; b < in.size(0); ++b)
    for (int64_t y = 0; y < H; ++y)
      for (int64_t x = 0; x < W; ++x) {
        const int64_t sy = y - dy[b].item<int64_t>(), sx = x - dx[b].item<int64_t>();
        if (sy >= 0 && sy < H && sx >= 0 && sx < W)
          out.index_put_({b, Slice(), y, x}, in.index({b, Slice(), sy, sx}));
      }
  return out;
}

// (row, col) of the single largest pixel of image b, channel 0.
std::pair<int64_t, int64_t> lit_pixel(const torch::Tensor& images, int64_t b) {
  const int64_t W = images.size(3);
  const int64_t i = images[b][0].flatten().argmax().item<int64_t>();
  return {i / W, i % W};
}

}  // namespace

TEST(TransformsTest, ToFloat) {
  auto u8 = torch::tensor({0, 51, 255, 128, 1, 254}, torch::kUInt8).view({2, 1, 3});
  auto f = to_float(u8);
  EXPECT_EQ(f.scalar_type(), torch::kFloat);
  EXPECT_EQ(f.sizes(), (std::vector<int64_t>{2, 1, 1, 3}));
  EXPECT_TRUE(torch::allclose(f.flatten(), torch::tensor({0.0f, 0.2f, 1.0f, 128 / 255.0f, 1 / 255.0f, 254 / 255.0f})));
  EXPECT_THROW(to_float(torch::zeros({2, 3, 3}, torch::kFloat)), c10::Error);
  // [B, C, H, W] (colour image folders) keeps its channels; 2-D and 5-D are refused.
  auto rgb = torch::full({2, 3, 4, 5}, 255, torch::kUInt8);
  auto g = to_float(rgb);
  EXPECT_EQ(g.sizes(), rgb.sizes());
  EXPECT_TRUE(torch::all(g == 1).item<bool>());
  EXPECT_THROW(to_float(torch::zeros({3, 3}, torch::kUInt8)), c10::Error);
  EXPECT_THROW(to_float(torch::zeros({1, 2, 1, 3, 3}, torch::kUInt8)), c10::Error);
}

TEST(TransformsTest, ShiftMovesSinglePixelExactly) {
  const int64_t H = 7, W = 9, y0 = 3, x0 = 4;
  const std::vector<std::pair<int64_t, int64_t>> shifts = {{0, 0}, {1, 0}, {0, 1}, {-2, 3}, {4, -3}, {-4, -3}};
  const int64_t B = static_cast<int64_t>(shifts.size());
  auto images = torch::zeros({B, 2, H, W});
  images.index_put_({Slice(), Slice(), y0, x0}, 1.0);
  auto dx = torch::empty({B}, torch::kLong), dy = torch::empty({B}, torch::kLong);
  for (int64_t b = 0; b < B; ++b) {
    dx[b] = shifts[b].first;
    dy[b] = shifts[b].second;
  }
  auto out = shift(images, dx, dy);
  ASSERT_EQ(out.sizes(), images.sizes());
  for (int64_t b = 0; b < B; ++b) {
    const auto [dxb, dyb] = shifts[b];
    for (int64_t c = 0; c < 2; ++c) {
      EXPECT_EQ(out[b][c].sum().item<float>(), 1.0f) << "b=" << b << " c=" << c;
      EXPECT_EQ(out[b][c][y0 + dyb][x0 + dxb].item<float>(), 1.0f) << "dx=" << dxb << " dy=" << dyb;
    }
  }
}

TEST(TransformsTest, ShiftDropsPixelsOffTheEdge) {
  const int64_t H = 5, W = 6;
  auto corner = torch::zeros({3, 1, H, W});
  corner.index_put_({Slice(), 0, 0, 0}, 1.0);
  // Left, up, and far right (beyond the width): the lit pixel leaves the image.
  auto out = shift(corner, torch::tensor(std::vector<int64_t>{-1, 0, W}), torch::tensor({0, -1, 0}, torch::kLong));
  EXPECT_EQ(out.abs().sum().item<float>(), 0.0f);

  // A full image shifted by (2, 1): zeros come in at the left two columns and the top row.
  auto ones = torch::ones({1, 1, H, W});
  auto s = shift(ones, torch::tensor({2}, torch::kLong), torch::tensor({1}, torch::kLong));
  EXPECT_EQ(s.sum().item<float>(), static_cast<float>((H - 1) * (W - 2)));
  EXPECT_EQ(s[0][0].narrow(1, 0, 2).sum().item<float>(), 0.0f);
  EXPECT_EQ(s[0][0][0].sum().item<float>(), 0.0f);
}

TEST(TransformsTest, ShiftMatchesReference) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto images = torch::rand({6, 3, 8, 5}, gen);
  auto dx = torch::randint(-6, 7, {6}, gen, torch::kLong);
  auto dy = torch::randint(-9, 10, {6}, gen, torch::kLong);
  EXPECT_TRUE(torch::equal(shift(images, dx, dy), shift_reference(images, dx, dy)));
  // int32 offsets and uint8 images work too.
  auto u8 = (images * 255).to(torch::kUInt8);
  EXPECT_TRUE(torch::equal(shift(u8, dx.to(torch::kInt), dy.to(torch::kInt)), shift_reference(u8, dx, dy)));
}

TEST(TransformsTest, ShiftOnGpuMatchesCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto images = torch::rand({4, 1, 28, 28});
  auto dx = torch::tensor({-2, 0, 1, 2}, torch::kLong), dy = torch::tensor({1, -2, 0, 2}, torch::kLong);
  auto gpu = shift(images.cuda(), dx, dy);
  EXPECT_TRUE(gpu.is_cuda());
  EXPECT_TRUE(torch::equal(gpu.cpu(), shift(images, dx, dy)));
}

TEST(TransformsTest, ShiftRejectsBadArguments) {
  auto images = torch::zeros({2, 1, 4, 4});
  auto ok = torch::zeros({2}, torch::kLong);
  EXPECT_THROW(shift(torch::zeros({2, 4, 4}), ok, ok), c10::Error);
  EXPECT_THROW(shift(images, torch::zeros({3}, torch::kLong), ok), c10::Error);
  EXPECT_THROW(shift(images, ok, torch::zeros({2, 1}, torch::kLong)), c10::Error);
  EXPECT_THROW(shift(images, torch::zeros({2}), ok), c10::Error);
}

TEST(TransformsTest, RandomShiftIsDeterministicForASeed) {
  auto images = torch::rand({64, 1, 28, 28});
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(42);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(42);
  auto g3 = at::make_generator<at::CPUGeneratorImpl>(43);
  auto a = random_shift(images, 2, g1);
  auto b = random_shift(images, 2, g2);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, random_shift(images, 2, g3)));
  // The generator advances: the next batch gets different shifts.
  EXPECT_FALSE(torch::equal(a, random_shift(images, 2, g1)));
}

TEST(TransformsTest, RandomShiftStaysWithinRangeAndCoversIt) {
  const int64_t B = 2000, S = 28, c = 14, max_shift = 2;
  auto images = torch::zeros({B, 1, S, S});
  images.index_put_({Slice(), 0, c, c}, 1.0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto out = random_shift(images, max_shift, gen);
  ASSERT_EQ(out.sizes(), images.sizes());
  // One lit pixel each, never lost (the shift is far smaller than the margin).
  EXPECT_TRUE(torch::equal(out.sum({1, 2, 3}), torch::ones({B})));
  std::set<std::pair<int64_t, int64_t>> seen;
  for (int64_t b = 0; b < B; ++b) {
    const auto [y, x] = lit_pixel(out, b);
    ASSERT_LE(std::abs(y - c), max_shift) << "b=" << b;
    ASSERT_LE(std::abs(x - c), max_shift) << "b=" << b;
    seen.insert({y - c, x - c});
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>((2 * max_shift + 1) * (2 * max_shift + 1)));
}

TEST(TransformsTest, RandomShiftZeroIsIdentity) {
  auto images = torch::rand({3, 1, 5, 5});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_TRUE(random_shift(images, 0, gen).is_same(images));
  EXPECT_THROW(random_shift(images, -1, gen), c10::Error);
}

// random_hflip: each image is itself or exactly its mirror image, about half of them mirrored, the same draws
// for the same seed; a non-4-D input is refused.
TEST(TransformsTest, RandomHflipMirrorsAboutHalfTheImagesReproducibly) {
  const int64_t B = 2000;
  const auto images = torch::rand({B, 2, 3, 5});  // asymmetric: no image equals its mirror
  auto g1 = at::make_generator<at::CPUGeneratorImpl>(11);
  auto g2 = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto out = random_hflip(images, g1);
  ASSERT_EQ(out.sizes(), images.sizes());
  EXPECT_TRUE(torch::equal(out, random_hflip(images, g2)));
  const auto mirror = images.flip({3});
  int64_t mirrored = 0;
  for (int64_t b = 0; b < B; ++b) {
    const bool same = torch::equal(out[b], images[b]), flipped = torch::equal(out[b], mirror[b]);
    ASSERT_NE(same, flipped) << "b=" << b;
    mirrored += flipped;
  }
  EXPECT_NEAR(mirrored, B / 2, 4 * std::sqrt(B / 4.0));  // binomial(2000, 1/2): sd 22.4
  EXPECT_TRUE(torch::equal(mirror[0].flip({2}), images[0]));
  EXPECT_THROW(random_hflip(torch::rand({3, 4, 4}), g1), c10::Error);
}
