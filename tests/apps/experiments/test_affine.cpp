// Affine-robustness experiment pieces: the paper's baseline CNN, translated 40x40 placement and the
// affNIST-style warp (identity, rotation, mass, determinism, range, containment, errors).
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "capsnet/data/affine.h"
#include "capsnet/data/idx.h"
#include "capsnet/data/transforms.h"
#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/viz/png.h"
#include "cli_helpers.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace capsnet {
namespace {

models::BaselineCnnConfig small_cnn(int64_t side = 12, bool pooling = true) {
  return testing::tiny_cnn_config(side, pooling);
}

/// Digit-like synthetic images: black background, strokes and a soft blob inside the central 20x20
/// box of a 28x28 image (as in MNIST), different per example. [N, 28, 28] uint8.
data::ImageSet digit_like_set(int64_t n, uint64_t seed) {
  // Built with whole-batch ops: a per-image loop of small ops is slow when the cores are contended.
  torch::manual_seed(seed);
  data::ImageSet set;
  set.labels = torch::arange(n, torch::kLong) % 10;
  const auto i = torch::arange(n, torch::kFloat).view({n, 1, 1});
  const auto ys = torch::arange(28, torch::kFloat).view({1, 28, 1}), xs = torch::arange(28, torch::kFloat).view({1, 1, 28});
  const auto r = torch::rand({n, 3}).view({n, 3, 1, 1});
  const auto cx = 10 + 8 * r.select(1, 0), cy = 10 + 8 * r.select(1, 1), width = 6 + 10 * r.select(1, 2);  // [n, 1, 1]
  auto img = torch::exp(-((xs - cx).pow(2) + (ys - cy).pow(2)) / width) * 255;  // a soft blob: [n, 28, 28]
  const auto inside_x = (xs >= 4) & (xs < 24), inside_y = (ys >= 4) & (ys < 24);
  const auto row = 4 + torch::fmod(i, 5), col = 6 + torch::fmod(3 * i, 14);
  img = torch::where((ys >= row) & (ys < row + 2) & inside_x, torch::full({}, 255.0f), img);  // horizontal stroke
  img = torch::where((xs >= col) & (xs < col + 2) & inside_y, torch::full({}, 200.0f), img);  // vertical stroke
  img = img * (inside_x & inside_y).to(torch::kFloat);  // nothing outside the central 20x20 box
  set.images = img.round().clamp(0, 255).to(torch::kUInt8);
  return set;
}

torch::Tensor map_tensor(const data::AffineParams& p, int64_t src, int64_t canvas) {
  auto A = data::affine_matrix(p, src, src, canvas, canvas);
  return torch::tensor(std::vector<double>(A.begin(), A.end()), torch::kDouble).view({1, 2, 3});
}

// ---- baseline CNN ----------------------------------------------------------------------------

TEST(BaselineCnnTest, OutputShapeFor28And40PixelInputs) {
  for (int64_t side : {28, 40}) {
    auto c = small_cnn(side);
    models::BaselineCnn cnn(c);
    auto logits = cnn(torch::rand({3, 1, side, side}));
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 10})) << side;
    EXPECT_EQ(c.feature_size(), side / 4);
  }
  models::BaselineCnn unpooled(small_cnn(12, false));
  EXPECT_EQ(unpooled(torch::rand({2, 1, 12, 12})).sizes(), (std::vector<int64_t>{2, 10}));
}

TEST(BaselineCnnTest, ParameterCountFollowsTheFormula) {
  // Hand-written formula for the small net: three 5x5 convs with biases, three linear layers.
  for (bool pooling : {true, false}) {
    auto c = small_cnn(12, pooling);
    const int64_t F = pooling ? 3 : 12;
    const int64_t expected = (1 * 6 * 25 + 6) + (6 * 5 * 25 + 5) + (5 * 4 * 25 + 4) + (4 * F * F * 16 + 16) +
                             (16 * 12 + 12) + (12 * 10 + 10);
    EXPECT_EQ(c.num_parameters(), expected);
    EXPECT_EQ(models::count_parameters(*models::BaselineCnn(c)), expected);
  }
  // The paper's layer sizes: our pooled default, and the unpooled "same"-padded net whose count is
  // the paper's 35.4M at 28x28.
  models::BaselineCnnConfig paper;
  EXPECT_EQ(paper.num_parameters(), 4587282);
  EXPECT_EQ(models::count_parameters(*models::BaselineCnn(paper)), 4587282);
  paper.image_size = 40;
  EXPECT_EQ(paper.num_parameters(), 6728466);
  paper.image_size = 28;
  paper.pooling = false;
  EXPECT_EQ(paper.num_parameters(), 35445522);
}

TEST(BaselineCnnTest, GradientReachesEveryParameter) {
  torch::manual_seed(3);
  auto c = small_cnn(12);
  c.dropout = 0.0;  // every unit contributes, so every weight must get a gradient
  models::BaselineCnn cnn(c);
  auto images = torch::rand({8, 1, 12, 12});
  auto labels = torch::arange(8, torch::kLong) % 10;
  auto loss = cnn->loss(cnn(images), labels);
  ASSERT_TRUE(std::isfinite(loss.item<double>()));
  loss.backward();
  for (const auto& item : cnn->named_parameters()) {
    const auto& g = item.value().grad();
    ASSERT_TRUE(g.defined()) << item.key();
    EXPECT_TRUE(torch::isfinite(g).all().item<bool>()) << item.key();
    EXPECT_GT(g.abs().sum().item<double>(), 0.0) << item.key();
  }
  // Cross-entropy of uniform logits is log K.
  auto uniform = torch::zeros({4, 10});
  EXPECT_NEAR(cnn->loss(uniform, torch::zeros({4}, torch::kLong)).item<double>(), std::log(10.0), 1e-6);
}

TEST(BaselineCnnTest, DropoutOnlyInTrainingMode) {
  torch::manual_seed(4);
  models::BaselineCnn cnn(small_cnn(12));  // dropout 0.5
  auto images = torch::rand({4, 1, 12, 12});
  cnn->eval();
  auto a = cnn(images), b = cnn(images);
  EXPECT_TRUE(torch::equal(a, b));
  cnn->train();
  auto t1 = cnn(images), t2 = cnn(images);
  EXPECT_FALSE(torch::equal(t1, t2));  // different dropout masks
  cnn->eval();
  EXPECT_TRUE(torch::equal(cnn(images), a));
}

TEST(BaselineCnnTest, ConfigJsonAndBadValues) {
  auto c = small_cnn(40);
  c.dropout = 0.25;
  auto back = models::BaselineCnnConfig::from_json(c.to_json());
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_THROW(models::BaselineCnnConfig::from_json({{"image_sise", 28}}), std::invalid_argument);
  EXPECT_THROW(models::BaselineCnnConfig::from_json({{"image_size", 28.5}}), std::invalid_argument);
  auto expect_bad = [](models::BaselineCnnConfig bad, const std::string& needle) {
    try {
      bad.validate();
      ADD_FAILURE() << "expected invalid_argument mentioning " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto bad = small_cnn();
  bad.image_size = 3;
  expect_bad(bad, "image_size 3");
  bad = small_cnn();
  bad.dropout = 1.0;
  expect_bad(bad, "dropout");
  bad = small_cnn();
  bad.kernel_size = 4;
  expect_bad(bad, "kernel_size");
  bad = small_cnn();
  bad.conv2_channels = 0;
  expect_bad(bad, "conv2_channels");
  models::BaselineCnn cnn(small_cnn(12));
  EXPECT_THROW(cnn(torch::rand({2, 1, 28, 28})), c10::Error);
  EXPECT_THROW(cnn->loss(torch::zeros({2, 10}), torch::zeros({3}, torch::kLong)), c10::Error);
}

TEST(AffineCapsNetTest, FortyPixelCapsNetHas4608PrimaryCapsulesAnd1600PixelDecoder) {
  models::CapsNetConfig c;
  c.image_size = 40;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.primary_grid(), 12);
  EXPECT_EQ(c.num_primary_caps(), 4608);
  torch::manual_seed(5);
  models::CapsNet net(c);
  torch::NoGradGuard no_grad;
  auto out = net(torch::rand({1, 1, 40, 40}));
  EXPECT_EQ(out.digit_caps.sizes(), (std::vector<int64_t>{1, 10, 16}));
  EXPECT_EQ(out.reconstruction.sizes(), (std::vector<int64_t>{1, 1600}));
}

// ---- placement in the 40x40 canvas -----------------------------------------------------------

TEST(AffineDataTest, PlacementKeepsTheWholeDigitInTheCanvas) {
  // Batches stay under LibTorch's parallel grain size (32768 elements): on contended cores every
  // parallel region can cost a scheduler time slice.
  auto set = digit_like_set(16, 1);
  auto images = data::to_float(set.images);  // [16, 1, 28, 28]
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto placed = data::place_in_canvas(images, 40, 6, gen);  // [16, 1, 40, 40]
  ASSERT_EQ(placed.sizes(), (std::vector<int64_t>{16, 1, 40, 40}));
  // An integer shift inside the 6 px border moves pixels without losing or changing any.
  EXPECT_TRUE(torch::allclose(placed.sum({1, 2, 3}), images.sum({1, 2, 3}), 1e-5, 1e-4));
  EXPECT_TRUE(torch::equal(std::get<0>(placed.flatten(1).sort(1)), std::get<0>(
      torch::cat({images.flatten(1), torch::zeros({16, 1600 - 784})}, 1).sort(1))));
  // Offsets vary (not all centred), and max_shift 0 is exactly the centred copy.
  auto gen0 = at::make_generator<at::CPUGeneratorImpl>(11);
  auto centred = data::place_in_canvas(images, 40, 0, gen0);
  EXPECT_TRUE(torch::equal(centred.narrow(2, 6, 28).narrow(3, 6, 28), images));
  EXPECT_TRUE(torch::allclose(centred.sum({1, 2, 3}), images.sum({1, 2, 3})));
  EXPECT_FALSE(torch::equal(placed, centred));
  // Same generator state, same placement.
  auto gen_again = at::make_generator<at::CPUGeneratorImpl>(11);
  EXPECT_TRUE(torch::equal(data::place_in_canvas(images, 40, 6, gen_again), placed));
  // translated_set returns the same pixels as uint8.
  auto translated = data::translated_set(set, 11, 40, 6);
  EXPECT_TRUE(torch::equal(data::to_float(translated.images), placed));
  EXPECT_TRUE(torch::equal(translated.labels, set.labels));
}

// ---- affNIST-style warp ------------------------------------------------------------------------

TEST(AffineDataTest, IdentityMapReproducesTheCentredDigit) {
  auto images = data::to_float(digit_like_set(3, 2).images);  // [3, 1, 28, 28]
  auto maps = map_tensor({}, 28, 40).expand({3, 2, 3});
  auto warped = data::warp_affine(images, maps, 40, 40);  // [3, 1, 40, 40]
  auto expected = torch::constant_pad_nd(images, {6, 6, 6, 6}, 0);
  EXPECT_LT((warped - expected).abs().max().item<float>(), 1e-6);
  // Same size in and out: the identity map is the identity.
  EXPECT_LT((data::warp_affine(images, map_tensor({}, 28, 28).expand({3, 2, 3}), 28, 28) - images)
                .abs()
                .max()
                .item<float>(),
            1e-6);
}

TEST(AffineDataTest, RotationBy90DegreesIsATransposeAndFlip) {
  // Asymmetric: an L shape plus a ramp, so every rotation and mirror is distinguishable.
  auto img = torch::zeros({20, 20});
  img.narrow(0, 3, 12).narrow(1, 4, 2).fill_(1);
  img.narrow(0, 13, 2).narrow(1, 4, 9).fill_(0.7);
  img += torch::arange(20, torch::kFloat).view({1, 20}) * 0.01;
  data::AffineParams p;
  p.rotation_deg = 90;
  auto out = data::warp_affine(img.view({1, 1, 20, 20}), map_tensor(p, 20, 20), 20, 20)[0][0];
  // Counter-clockwise on screen = transpose, then flip the rows.
  auto ccw = img.t().flip({0});
  EXPECT_LT((out - ccw).abs().max().item<float>(), 1e-4);
  EXPECT_TRUE(torch::allclose(ccw, torch::rot90(img, 1, {0, 1})));
  EXPECT_GT((out - img).abs().max().item<float>(), 0.5);  // it did rotate
  p.rotation_deg = -90;
  auto cw = data::warp_affine(img.view({1, 1, 20, 20}), map_tensor(p, 20, 20), 20, 20)[0][0];
  EXPECT_LT((cw - img.t().flip({1})).abs().max().item<float>(), 1e-4);
}

TEST(AffineDataTest, MassIsPreservedAtScaleOneAndScalesWithTheDeterminant) {
  auto images = data::to_float(digit_like_set(8, 3).images);  // [8, 1, 28, 28]
  const auto mass = images.sum({1, 2, 3});
  for (double rot : {-20.0, 7.0, 20.0}) {
    for (double shear : {-0.1, 0.0, 0.1}) {
      data::AffineParams p;
      p.rotation_deg = rot;
      p.shear = shear;  // det = 1: rotation and shear keep areas
      auto warped = data::warp_affine(images, map_tensor(p, 28, 40).expand({8, 2, 3}), 40, 40);
      auto ratio = warped.sum({1, 2, 3}) / mass;
      EXPECT_LT((ratio - 1).abs().max().item<double>(), 0.03) << "rotation " << rot << " shear " << shear;
    }
  }
  data::AffineParams p;
  p.scale_x = 1.2;
  p.scale_y = 0.8;
  auto ratio = data::warp_affine(images, map_tensor(p, 28, 40).expand({8, 2, 3}), 40, 40).sum({1, 2, 3}) / mass;
  // Shrinking 2-px strokes by 0.8 without a prefilter aliases: single digits are off by a few percent,
  // the average is close to the area factor 1.2 * 0.8.
  EXPECT_LT((ratio - 0.96).abs().max().item<double>(), 0.05);
  EXPECT_LT(std::abs(ratio.mean().item<double>() - 0.96), 0.015);
}

TEST(AffineDataTest, OutputsStayInTheUnitRange) {
  torch::manual_seed(6);
  auto images = torch::rand({16, 1, 28, 28});
  std::vector<torch::Tensor> maps;
  for (int64_t i = 0; i < 16; ++i) {
    auto p = data::draw_affine_params(9, i, {0, 0, 27, 27}, 28, 28, 40);
    maps.push_back(map_tensor(p, 28, 40));
  }
  auto warped = data::warp_affine(images, torch::cat(maps), 40, 40);
  EXPECT_GE(warped.min().item<float>(), 0.0f);
  EXPECT_LE(warped.max().item<float>(), 1.0f + 1e-6f);
  EXPECT_GT(warped.max().item<float>(), 0.5f);
  auto set = data::affine_test_set(digit_like_set(16, 4), 9);
  auto f = data::to_float(set.images);
  EXPECT_GE(f.min().item<float>(), 0.0f);
  EXPECT_LE(f.max().item<float>(), 1.0f);
}

TEST(AffineDataTest, TestSetIsDeterministicPerSeedAndIndex) {
  auto source = digit_like_set(16, 5);
  auto a = data::affine_test_set(source, 123), b = data::affine_test_set(source, 123);
  ASSERT_EQ(a.images.sizes(), (std::vector<int64_t>{16, 40, 40}));
  EXPECT_EQ(a.images.scalar_type(), torch::kUInt8);
  EXPECT_TRUE(torch::equal(a.images, b.images));
  EXPECT_TRUE(torch::equal(a.labels, source.labels));
  // Example i depends on (seed, i) only: a prefix of the source gives a prefix of the set.
  auto prefix = data::affine_test_set(data::take(source, 7), 123);
  EXPECT_TRUE(torch::equal(prefix.images, a.images.narrow(0, 0, 7)));
  auto other = data::affine_test_set(source, 124);
  EXPECT_FALSE(torch::equal(other.images, a.images));
  // The drawn parameters are within the documented ranges and differ between examples.
  const data::AffineRanges ranges;
  auto p0 = data::draw_affine_params(123, 0, {4, 4, 23, 23}, 28, 28, 40);
  auto p1 = data::draw_affine_params(123, 1, {4, 4, 23, 23}, 28, 28, 40);
  EXPECT_NE(p0.rotation_deg, p1.rotation_deg);
  for (int64_t i = 0; i < 200; ++i) {
    auto p = data::draw_affine_params(123, i, {4, 4, 23, 23}, 28, 28, 40);
    EXPECT_LE(std::abs(p.rotation_deg), ranges.max_rotation_deg);
    EXPECT_LE(std::abs(p.shear), ranges.max_shear);
    EXPECT_GE(std::min(p.scale_x, p.scale_y), ranges.min_scale);
    EXPECT_LE(std::max(p.scale_x, p.scale_y), ranges.max_scale);
  }
}

TEST(AffineDataTest, WarpedDigitsStayInsideTheCanvas) {
  auto source = digit_like_set(20, 6);
  const uint64_t seed = 77;
  auto set = data::affine_test_set(source, seed);
  double max_abs_t = 0;
  const auto src_mass = source.images.to(torch::kDouble).sum({1, 2}), out_mass = set.images.to(torch::kDouble).sum({1, 2});
  for (int64_t i = 0; i < source.size(); ++i) {
    const auto box = data::bounding_box(source.images[i]);
    ASSERT_FALSE(box.empty());
    EXPECT_TRUE(box.x0 >= 4 && box.y0 >= 4 && box.x1 <= 23 && box.y1 <= 23);  // the central 20x20 box
    const auto p = data::draw_affine_params(seed, i, box, 28, 28, 40);
    max_abs_t = std::max({max_abs_t, std::abs(p.tx), std::abs(p.ty)});
    // Nothing cropped: the warped mass is the source mass times the area factor sx * sy (the
    // uint8 rounding and bilinear sampling cost a few percent at most).
    const double ratio = out_mass[i].item<double>() / (src_mass[i].item<double>() * p.scale_x * p.scale_y);
    EXPECT_NEAR(ratio, 1.0, 0.05) << "example " << i;
  }
  EXPECT_GT(max_abs_t, 3.0);  // the translations do move digits around the canvas
  EXPECT_TRUE(data::bounding_box(torch::zeros({5, 5})).empty());
}

TEST(AffineDataTest, BadArgumentsThrowClearly) {
  auto images = torch::rand({2, 1, 28, 28});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  auto message_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(no exception)";
  };
  EXPECT_NE(message_of([&] { data::place_in_canvas(images, 40, 7, gen); }).find("max_shift must be in [0, 6]"),
            std::string::npos);
  EXPECT_NE(message_of([&] { data::place_in_canvas(images, 20, 0, gen); }).find("canvas 20 is smaller"),
            std::string::npos);
  EXPECT_NE(message_of([&] { data::place_in_canvas(images[0], 40, 0, gen); }).find("[B, C, H, W]"),
            std::string::npos);
  data::AffineParams flat;
  flat.scale_y = 0;
  EXPECT_NE(message_of([&] { data::warp_affine(images.narrow(0, 0, 1), map_tensor(flat, 28, 40), 40, 40); })
                .find("singular"),
            std::string::npos);
  EXPECT_NE(message_of([&] { data::warp_affine(images, torch::zeros({2, 3, 3}), 40, 40); }).find("[B, 2, 3]"),
            std::string::npos);
  auto set = digit_like_set(2, 7);
  EXPECT_NE(message_of([&] { data::affine_test_set(set, 1, 20); }).find("canvas 20"), std::string::npos);
  data::AffineRanges bad;
  bad.min_scale = 1.5;
  EXPECT_NE(message_of([&] { data::affine_test_set(set, 1, 40, bad); }).find("min_scale"), std::string::npos);
  data::ImageSet floats{torch::rand({2, 28, 28}), torch::zeros({2}, torch::kLong)};
  EXPECT_NE(message_of([&] { data::affine_test_set(floats, 1); }).find("uint8"), std::string::npos);
  EXPECT_THROW(data::affine_matrix({}, 0, 28, 40, 40), std::invalid_argument);
}

/// Each image's ink-weighted spread around its own centre of mass along its principal axes: the larger
/// and the smaller standard deviation in pixels.
std::vector<std::pair<double, double>> principal_spreads(const data::ImageSet& set) {
  std::vector<std::pair<double, double>> out;
  const auto images = set.images.to(torch::kDouble);
  const int64_t h = images.size(1), w = images.size(2);
  const auto ys = torch::arange(h, torch::kDouble).view({h, 1}).expand({h, w});
  const auto xs = torch::arange(w, torch::kDouble).view({1, w}).expand({h, w});
  for (int64_t i = 0; i < set.size(); ++i) {
    const auto m = images[i];
    const double mass = m.sum().item<double>();
    const double cx = (m * xs).sum().item<double>() / mass, cy = (m * ys).sum().item<double>() / mass;
    const double sxx = (m * (xs - cx).pow(2)).sum().item<double>() / mass;
    const double syy = (m * (ys - cy).pow(2)).sum().item<double>() / mass;
    const double sxy = (m * (xs - cx) * (ys - cy)).sum().item<double>() / mass;
    const double mid = (sxx + syy) / 2, rad = std::sqrt((sxx - syy) * (sxx - syy) / 4 + sxy * sxy);
    out.emplace_back(std::sqrt(mid + rad), std::sqrt(std::max(0.0, mid - rad)));
  }
  return out;
}

// The robustness family: 12 sets, each family varying only its own parameter at increasing severity;
// rotation and shear keep the ink (area-preserving), rotation keeps each digit's principal spreads (a
// rigid motion), and a stronger shear or anisotropic scale changes each digit's shape more.
TEST(AffineDataTest, TheRobustnessFamilyVariesOneWarpAtATimeAndItsSetsShowIt) {
  const auto family = data::robustness_family();
  ASSERT_EQ(family.size(), 12u);
  EXPECT_EQ(family[0].family, "none");
  std::map<std::string, double> last;
  for (const auto& w : family) {
    if (last.count(w.family)) EXPECT_GT(w.severity, last[w.family]) << w.name;
    last[w.family] = w.severity;
    const auto& r = w.ranges;
    EXPECT_NO_THROW(r.validate());
    const bool rotates = r.max_rotation_deg > 0, shears = r.max_shear > 0, scales = r.min_scale != 1 || r.max_scale != 1;
    if (w.family == "rotation") EXPECT_TRUE(rotates && !shears && !scales) << w.name;
    if (w.family == "shear") EXPECT_TRUE(!rotates && shears && !scales) << w.name;
    if (w.family == "scale") EXPECT_TRUE(!rotates && !shears && scales) << w.name;
    if (w.family == "none") EXPECT_TRUE(!rotates && !shears && !scales) << w.name;
  }
  EXPECT_EQ(last.size(), 5u);

  // Example i of every set is source digit i, so the sets compare digit by digit.
  const auto source = digit_like_set(24, 51);
  std::vector<data::ImageSet> sets;
  for (const auto& w : family) sets.push_back(data::affine_test_set(source, 7, 40, w.ranges));
  const auto ink = [](const data::ImageSet& s) { return s.images.to(torch::kDouble).sum().item<double>(); };
  EXPECT_NEAR(ink(sets[4]) / ink(sets[0]), 1.0, 0.03);  // rotation ±45°
  EXPECT_NEAR(ink(sets[7]) / ink(sets[0]), 1.0, 0.03);  // shear ±0.4
  const auto base = principal_spreads(sets[0]);
  // Mean relative change of each digit's (major, minor) spreads against the unwarped placement.
  const auto change = [&](size_t k) {
    const auto s = principal_spreads(sets[k]);
    double sum = 0;
    for (size_t i = 0; i < s.size(); ++i)
      sum += std::abs(s[i].first / base[i].first - 1) + std::abs(s[i].second / base[i].second - 1);
    return sum / (2.0 * s.size());
  };
  EXPECT_LT(change(4), 0.04);               // rotation ±45°: a rigid motion
  EXPECT_GT(change(7), change(5));          // shear 0.4 vs 0.1
  EXPECT_GT(change(9), change(8));          // scale 1 ± 0.4 vs 1 ± 0.2
  EXPECT_GT(change(9), 2 * change(4));
}

// ---- the `capsnet affine` command, end to end on a fake MNIST directory ------------------------

TEST(AffineCliTest, TrainsBothModelsAndWritesReportFigureAndMetrics) {
  const testing::CliFolder run("run");
  const std::string& out = run.out;
  testing::write_mnist_dir(run.data, digit_like_set(16, 21), digit_like_set(6, 22));
  auto r = run.run("affine", "--model both --steps 1 --batch-size 2");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("NOT the real affNIST"), std::string::npos) << r.output;
  std::ifstream in(out + "/affine.json");
  ASSERT_TRUE(in.good());
  nlohmann::json report;
  in >> report;
  ASSERT_EQ(report["results"].size(), 2u);
  EXPECT_EQ(report["results"][0]["model"], "capsnet");
  EXPECT_EQ(report["results"][0]["config"]["image_size"], 40);
  EXPECT_EQ(report["results"][1]["model"], "cnn");
  EXPECT_EQ(report["results"][1]["parameters"], 6728466);
  for (const auto& m : report["results"]) {
    EXPECT_EQ(m["training_images_seen"], 2);
    for (const char* key : {"translated_mnist_accuracy", "affnist_style_accuracy"}) {
      const double acc = m[key];
      EXPECT_TRUE(acc >= 0 && acc <= 1) << key;
    }
  }
  // The 6 test digits: a row of centred digits above a row of their warped versions (12 columns).
  auto figure = viz::read_png_gray(out + "/affnist_style_examples.png");
  EXPECT_EQ(figure.size(0), 2 * 42 + 2);
  EXPECT_EQ(figure.size(1), 12 * 42 + 2);
  std::ifstream metrics(out + "/metrics.jsonl");
  std::string line;
  int evals = 0;
  while (std::getline(metrics, line)) evals += nlohmann::json::parse(line)["event"] == "eval";
  EXPECT_EQ(evals, 4);  // 2 models x 2 test sets

  EXPECT_TRUE(testing::FailsSaying(run.run("affine", "--model resnet"), "resnet"));
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  nlohmann::json j;
  in >> j;
  return j;
}

// The robustness curve: every model is scored on 12 warped copies of the same test digits (each warp
// family at increasing severity); a set's accuracy is the model's on exactly the set its entry describes
// (recomputed here from the checkpoint and the entry's seed and ranges).
TEST(AffineCliTest, EveryModelIsScoredOnEachWarpOfTheRobustnessFamily) {
  const testing::CliFolder run("run");
  const std::string& out = run.out;
  const auto test = digit_like_set(12, 42);
  testing::write_mnist_dir(run.data, digit_like_set(16, 41), test);
  auto r = run.run("affine", "--model cnn --steps 1 --batch-size 4 --lr 1e-9 --precision fp32");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto report = read_json(out + "/affine.json");
  const auto& sets = report["robustness_sets"];
  ASSERT_EQ(sets.size(), 12u);
  std::map<std::string, double> last_severity;
  std::set<uint64_t> seeds;
  for (const auto& s : sets) {
    const std::string family = s["family"];
    const double severity = s["severity"];
    if (last_severity.count(family)) EXPECT_GT(severity, last_severity[family]) << s;  // increasing per family
    last_severity[family] = severity;
    seeds.insert(s["seed"].get<uint64_t>());
  }
  EXPECT_EQ(seeds.size(), 12u);  // every set draws its own warps
  EXPECT_EQ(last_severity.size(), 5u);
  const auto& row = report["results"][0];
  ASSERT_EQ(row["robustness"].size(), 12u);

  models::BaselineCnnConfig c;
  c.image_size = 40;
  models::BaselineCnn model(c);
  train::load_checkpoint(out + "/cnn/checkpoint.pt", *model, nullptr, [](const nlohmann::json&) { return true; });
  model->eval();
  torch::NoGradGuard no_grad;
  for (const size_t k : {size_t{0}, size_t{4}, size_t{7}, size_t{11}}) {  // none, rotation 45, shear 0.4, combined
    data::AffineRanges ranges;
    ranges.max_rotation_deg = sets[k]["rotation_deg"];
    ranges.max_shear = sets[k]["shear"];
    ranges.min_scale = sets[k]["scale"][0];
    ranges.max_scale = sets[k]["scale"][1];
    const auto warped = data::affine_test_set(test, sets[k]["seed"].get<uint64_t>(), 40, ranges);
    const double acc =
        model(data::to_float(warped.images)).argmax(1).eq(warped.labels).to(torch::kDouble).mean().item<double>();
    EXPECT_DOUBLE_EQ(row["robustness"][sets[k]["name"].get<std::string>()].get<double>(), acc) << sets[k];
  }
  // The table: a header, a rule and one row per set.
  std::ifstream md(out + "/robustness.md");
  std::string text((std::istreambuf_iterator<char>(md)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("| rotation ±45° |"), std::string::npos) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2 + 2 + 12) << text;

  // --no-robustness skips it.
  const std::string plain = run.dir / "plain";
  r = run.run_to(plain, "affine", "--model cnn --steps 1 --batch-size 4 --no-robustness");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_FALSE(read_json(plain + "/affine.json")["results"][0].contains("robustness"));
  EXPECT_FALSE(std::filesystem::exists(plain + "/robustness.md"));
}

// Trains `model` (capsnet or cnn) for one step in `run` on 8 training and 4 test digits (digit_like_set with
// seeds seed and seed + 1) and returns its checkpoint.
std::string train_one_step(const testing::CliFolder& run, const std::string& model, uint64_t seed) {
  testing::write_mnist_dir(run.data, digit_like_set(8, seed), digit_like_set(4, seed + 1));
  auto r = run.run("affine", "--model " + model + " --steps 1 --batch-size 2 --no-robustness");
  EXPECT_EQ(r.status, 0) << r.output;
  return run.out + "/" + model + "/checkpoint.pt";
}

// A trained 40x40 model is scored by `capsnet eval --images X --labels Y` on any labelled IDX set of its
// side (here generated), with the same accuracy the model gives those images; a set of another side, a
// label file of another length, or one of the two flags alone is refused in one line.
TEST(AffineCliTest, EvalScoresAFortyPixelModelOnAnyIdxSetOfItsSide) {
  const testing::CliFolder run("run");
  const auto& dir = run.dir;
  const std::string ckpt = train_one_step(run, "capsnet", 61);
  ASSERT_FALSE(HasFailure());
  const auto set = data::affine_test_set(digit_like_set(12, 63), 5, 40);  // 12 images of 40x40
  const std::string images = dir / "x40-images", labels = dir / "x40-labels", labels5 = dir / "five-labels";
  data::write_idx(images, set.images);
  data::write_idx(labels, set.labels.to(torch::kUInt8));
  data::write_idx(labels5, set.labels.narrow(0, 0, 5).to(torch::kUInt8));

  auto r = testing::run_cli("eval --checkpoint " + ckpt + " --images " + images + " --labels " + labels +
                            " --precision fp32 --json --threads 1");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["examples"], 12);
  EXPECT_EQ(j["split"], images);
  auto model = train::load_model(ckpt);
  model->eval();
  torch::NoGradGuard no_grad;
  const double acc =
      model(data::to_float(set.images)).lengths.argmax(1).eq(set.labels).to(torch::kDouble).mean().item<double>();
  EXPECT_DOUBLE_EQ(j["accuracy"].get<double>(), acc);

  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {" --images " + run.data + "/t10k-images-idx3-ubyte --labels " + run.data + "/t10k-labels-idx1-ubyte",
            "images are 28x28, but the model"},
           {" --images " + images + " --labels " + labels5, "5 labels but"},
           {" --images " + images, "--labels"}})
    EXPECT_TRUE(testing::FailsSaying(testing::run_cli("eval --checkpoint " + ckpt + args), needle)) << args;
}

// The baseline CNN of a comparison is a model like the others: eval scores its checkpoint and its fp16
// export on an IDX set (the accuracy its logits give), predict writes softmax probabilities whose
// argmax is the class, and what a CNN cannot do (poses; a 40x40 model on 28x28 MNIST) is refused in one line.
TEST(AffineCliTest, TheBaselineCnnIsEvaluatedExportedAndPredictedLikeAnyModel) {
  const testing::CliFolder run("run");
  const auto& dir = run.dir;
  const std::string ckpt = train_one_step(run, "cnn", 81), weights = dir / "cnn.pt";
  ASSERT_FALSE(HasFailure());
  const auto set = data::affine_test_set(digit_like_set(6, 83), 7, 40);  // 6 images of 40x40
  const std::string images = dir / "x40-images", labels = dir / "x40-labels";
  data::write_idx(images, set.images);
  data::write_idx(labels, set.labels.to(torch::kUInt8));
  auto r = testing::run_cli("export --checkpoint " + ckpt + " --storage fp16 --probe 2 --out " + weights);
  ASSERT_EQ(r.status, 0) << r.output;

  torch::NoGradGuard no_grad;
  for (const auto& file : {ckpt, weights}) {
    r = testing::run_cli("eval --checkpoint " + file + " --images " + images + " --labels " + labels +
                         " --json --threads 1");
    ASSERT_EQ(r.status, 0) << r.output;
    const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
    EXPECT_EQ(j["model"], "baseline-cnn");
    EXPECT_EQ(j["examples"], 6);
    auto model = train::load_baseline_cnn(file);
    auto logits = model(data::to_float(set.images));
    EXPECT_DOUBLE_EQ(j["accuracy"].get<double>(),
                     logits.argmax(1).eq(set.labels).to(torch::kDouble).mean().item<double>());
    EXPECT_NEAR(j["loss"].get<double>(), torch::nn::functional::cross_entropy(logits, set.labels).item<double>(),
                1e-5);
  }

  r = testing::run_cli("predict " + images + " --checkpoint " + weights + " --format jsonl --limit 0");
  ASSERT_EQ(r.status, 0) << r.output;
  auto model = train::load_baseline_cnn(weights);
  const auto probabilities = torch::softmax(model(data::to_float(set.images)), 1);  // [6, 10]
  std::istringstream lines(r.output);
  int64_t row = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    const auto j = nlohmann::json::parse(line);
    ASSERT_LT(row, 6);
    const auto p = j["probabilities"].get<std::vector<double>>();
    ASSERT_EQ(p.size(), 10u);
    for (int64_t k = 0; k < 10; ++k) EXPECT_NEAR(p[k], probabilities[row][k].item<double>(), 1e-5) << row;
    EXPECT_EQ(j["prediction"], probabilities[row].argmax().item<int64_t>());
    EXPECT_NEAR(j["probability"].get<double>(), probabilities[row].max().item<double>(), 1e-5);
    ++row;
  }
  EXPECT_EQ(row, 6);

  for (const auto& [command, needle] : std::vector<std::pair<std::string, std::string>>{
           {"predict " + images + " --pose --checkpoint " + weights, "no capsule poses"},
           {"eval --data " + run.data + " --checkpoint " + weights, "takes 40x40 images, but --dataset is 28x28"}})
    EXPECT_TRUE(testing::FailsSaying(testing::run_cli(command), needle)) << command;
}

// --write-sets writes every test set as IDX files that hold exactly the generator's digits, with sets.json
// giving each set's seed and ranges, and trains nothing; eval scores a 40x40 model on any of them.
TEST(AffineCliTest, WriteSetsWritesEveryTestSetAsIdxWithItsRecipeAndTrainsNothing) {
  const testing::CliFolder run("never");
  const std::string sets = run.dir / "sets";
  const std::string& out = run.out;
  const auto test_digits = digit_like_set(6, 72);
  testing::write_mnist_dir(run.data, digit_like_set(8, 71), test_digits);
  auto r = run.run("affine", "--write-sets " + sets + " --test-limit 0 --test-seed 31");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out)) << "nothing is trained";
  const auto manifest = nlohmann::json::parse(std::ifstream(sets + "/sets.json"));
  EXPECT_EQ(manifest["test_seed"], 31);
  EXPECT_EQ(manifest["test_digits"], 6);
  const auto family = data::robustness_family();
  ASSERT_EQ(manifest["files"].size(), family.size() + 2);
  ASSERT_EQ(manifest["robustness_sets"].size(), family.size());

  auto read_set = [&](const std::string& stem) {
    const auto& files = manifest["files"][stem];
    return data::load_idx_set(sets + "/" + files["images"].get<std::string>(),
                              sets + "/" + files["labels"].get<std::string>());
  };
  const auto translated = read_set("translated");
  const auto expected = data::translated_set(test_digits, 31, 40, 6);
  EXPECT_TRUE(torch::equal(translated.images, expected.images));
  EXPECT_TRUE(torch::equal(translated.labels, expected.labels));
  EXPECT_TRUE(torch::equal(read_set("affnist-style").images,
                           data::affine_test_set(test_digits, 31, 40, data::AffineRanges{}).images));
  // Each robustness set from its recorded seed and ranges, e.g. rotation alone up to 30 degrees.
  for (size_t k = 0; k < family.size(); ++k) {
    const auto& rec = manifest["robustness_sets"][k];
    data::AffineRanges ranges = family[k].ranges;
    EXPECT_EQ(rec["seed"].get<uint64_t>(), 31 + 100 + k);
    const std::string stem = fmt::format("{}-{:g}", family[k].family, family[k].severity);
    ASSERT_TRUE(manifest["files"].contains(stem)) << stem;
    EXPECT_TRUE(torch::equal(read_set(stem).images,
                             data::affine_test_set(test_digits, rec["seed"].get<uint64_t>(), 40, ranges).images))
        << stem;
  }
  EXPECT_TRUE(manifest["files"].contains("rotation-30"));

  // A model trained by affine scores on a written set through eval.
  r = run.run("affine", "--model capsnet --steps 1 --batch-size 2 --no-robustness");
  ASSERT_EQ(r.status, 0) << r.output;
  r = testing::run_cli("eval --checkpoint " + out + "/capsnet/checkpoint.pt --images " + sets +
                       "/rotation-30-images-idx3-ubyte --labels " + sets +
                       "/rotation-30-labels-idx1-ubyte --json --threads 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output.substr(r.output.find('{')))["examples"], 6);
}

// The paper's protocol: whole epochs, each model evaluated on the translated test set after every
// epoch and stopped at its target; --resume continues each model from its own checkpoint.
TEST(AffineCliTest, EpochModeEvaluatesEveryEpochStopsAtTheTargetAndResumes) {
  const testing::CliFolder run("run");
  const std::string& out = run.out;
  testing::write_mnist_dir(run.data, digit_like_set(16, 31), digit_like_set(6, 32));
  const std::string common = "--model cnn --batch-size 8 --precision fp32 ";
  // 16 images, batch 8: 2 steps per epoch. Target 100% on 6 test digits.
  auto first = run.run("affine", common + "--epochs 2 --target-accuracy 1");
  ASSERT_EQ(first.status, 0) << first.output;
  auto row = read_json(out + "/affine.json")["results"][0];
  const auto& curve = row["epoch_curve"];
  ASSERT_GE(curve.size(), 1u);
  if (row["target_reached"].get<bool>()) {
    EXPECT_EQ(curve.back()["accuracy"], 1.0);
    EXPECT_EQ(row["steps"], 2 * static_cast<int64_t>(curve.size()));
    GTEST_SKIP() << "6 digits reached 100% by chance: the resume half of this test does not apply";
  }
  EXPECT_EQ(curve.size(), 2u) << "one translated-test evaluation per epoch";
  EXPECT_EQ(row["steps"], 4);
  EXPECT_EQ(row["training_images_seen"], 32);
  EXPECT_NE(first.output.find("target not reached"), std::string::npos) << first.output;
  // The epoch-end evaluation is the final report's translated-test accuracy (same weights, same set).
  EXPECT_EQ(curve.back()["accuracy"], row["translated_mnist_accuracy"]);

  // A part stopped by a signal writes no "end" record: drop it, as a killed run would have.
  const std::string model_metrics = out + "/cnn/metrics.jsonl";
  std::string kept;
  {
    std::ifstream in(model_metrics);
    for (std::string line; std::getline(in, line);)
      if (nlohmann::json::parse(line).at("event") != "end") kept += line + "\n";
  }
  std::ofstream(model_metrics) << kept;

  // One more epoch, continued exactly from the checkpoint: the curve keeps its first two points.
  auto resumed = run.run("affine", common + "--epochs 3 --target-accuracy 1 --resume");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  auto row2 = read_json(out + "/affine.json")["results"][0];
  EXPECT_EQ(row2["steps"], 6);
  // The first part's 2 epochs still count (from its last "train" record), plus the third's.
  EXPECT_GT(row2["train_seconds"].get<double>(), row["train_seconds"].get<double>());
  EXPECT_EQ(row2["training_images_seen"], 48);
  ASSERT_EQ(row2["epoch_curve"].size(), 3u);
  EXPECT_EQ(row2["epoch_curve"][1], curve[1]);

  EXPECT_TRUE(testing::FailsSaying(run.run("affine", common + "--target-accuracy 0.99"), "--epochs"));
}

// --eval-every validates between epoch ends (the target is checked there: LoopTest covers the stop), and
// never spends test time there: the translated test set is scored at the epoch end only.
TEST(AffineCliTest, EvalEveryValidatesBetweenEpochsWithoutTesting) {
  const testing::CliFolder run("run");
  testing::write_mnist_dir(run.data, digit_like_set(16, 33), digit_like_set(6, 34));
  const std::string common = "--model cnn --batch-size 4 --precision fp32 --no-robustness --epochs 1 ";
  // 16 images less 4 held out, batch 4: 3 steps, validated at each.
  auto r = run.run("affine", common + "--val 4 --eval-every 1");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto row = read_json(run.out + "/affine.json")["results"][0];
  std::vector<std::pair<std::string, int64_t>> points;
  for (const auto& p : row["epoch_curve"]) points.emplace_back(p["split"].get<std::string>(), p["step"].get<int64_t>());
  const std::vector<std::pair<std::string, int64_t>> expected = {
      {"val", 1}, {"val", 2}, {"val", 3}, {"translated_mnist", 3}};
  EXPECT_EQ(points, expected) << row.dump() << "\n" << r.output;
  EXPECT_TRUE(testing::FailsSaying(run.run("affine", common + "--eval-every 1"), "--eval-every needs --val"));
}

}  // namespace
}  // namespace capsnet
