// MultiMNIST: generator invariants (classes, determinism, overlay, shifts, overlap statistic, errors),
// the two-target loss and metric, a tiny training run, and the figure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "capsnet/data/idx.h"
#include "capsnet/data/multimnist.h"
#include "capsnet/train/checkpoint.h"
#include "apps/experiments/multimnist.h"
#include "capsnet/train/trainer.h"
#include "capsnet/viz/png.h"
#include "cli_helpers.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace capsnet {
namespace {

using data::MultiMnist;
using testing::TempDir;

/// Class k = a solid 20x20 square (rows and columns 4..23) of intensity 60 + 19k: every digit's ink box is
/// exactly 20x20, so the overlap statistic has a closed form.
data::ImageSet square_digits(int64_t n) {
  data::ImageSet set;
  set.labels = torch::arange(n, torch::kLong) % 10;
  set.images = torch::zeros({n, 28, 28}, torch::kUInt8);
  for (int64_t i = 0; i < n; ++i)
    set.images[i].narrow(0, 4, 20).narrow(1, 4, 20).fill_(60 + 19 * set.labels[i].item<int64_t>());
  return set;
}

/// Ink everywhere up to the border of the 28x28 frame: any clipping of a shifted digit would lose mass.
data::ImageSet full_frame_digits(int64_t n) {
  auto set = testing::synthetic_set(n, 28, 3);
  set.images.add_(1);  // no zero pixel (synthetic noise is in [0, 60), bars are 255 -> 0 after +1 wraps)
  set.images.masked_fill_(set.images.eq(0), 255);
  return set;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

TEST(MultiMnistTest, BatchShapesAndRanges) {
  MultiMnist gen(square_digits(100), 5);
  EXPECT_EQ(gen.canvas_size(), 36);
  auto b = gen.generate(0, 8);
  EXPECT_EQ(b.images.sizes(), (std::vector<int64_t>{8, 1, 36, 36}));
  EXPECT_EQ(b.digits.sizes(), (std::vector<int64_t>{8, 2, 1, 36, 36}));
  EXPECT_EQ(b.labels.sizes(), (std::vector<int64_t>{8, 2}));
  EXPECT_EQ(b.images.scalar_type(), torch::kFloat);
  EXPECT_EQ(b.labels.scalar_type(), torch::kLong);
  EXPECT_GE(b.digits.min().item<float>(), 0.0f);
  EXPECT_LE(b.digits.max().item<float>(), 1.0f);
}

TEST(MultiMnistTest, TheTwoClassesAlwaysDifferAndEveryOtherClassIsUsed) {
  auto source = square_digits(200);
  MultiMnist gen(source, 11);
  auto b = gen.generate(0, 2000);
  EXPECT_TRUE(b.labels.select(1, 0).ne(b.labels.select(1, 1)).all().item<bool>());
  // Each class is paired with each of the 9 others.
  std::set<std::pair<int64_t, int64_t>> pairs;
  auto acc = b.labels.accessor<int64_t, 2>();
  for (int64_t i = 0; i < 2000; ++i) pairs.insert({acc[i][0], acc[i][1]});
  EXPECT_EQ(pairs.size(), 90u);
  // Labels are those of the source digits actually used.
  for (int64_t n : {0, 17, 1999}) {
    auto e = gen.example(n);
    EXPECT_EQ(e.labels[0], source.labels[e.source[0]].item<int64_t>());
    EXPECT_EQ(e.labels[1], source.labels[e.source[1]].item<int64_t>());
  }
}

TEST(MultiMnistTest, ExampleIsAPureFunctionOfSeedAndIndex) {
  auto source = full_frame_digits(60);
  MultiMnist a(source, 42), b(source, 42), other(source, 43);
  auto x = a.generate(100, 50), y = b.generate(100, 50);
  EXPECT_TRUE(torch::equal(x.images, y.images));
  EXPECT_TRUE(torch::equal(x.digits, y.digits));
  EXPECT_TRUE(torch::equal(x.labels, y.labels));
  // Independent of how the examples are batched.
  for (int64_t k : {0, 1, 37, 49}) {
    auto single = a.generate(100 + k, 1);
    EXPECT_TRUE(torch::equal(single.digits[0], x.digits[k])) << "example " << 100 + k;
    EXPECT_TRUE(torch::equal(a.example(100 + k).image, x.images[k][0]));
  }
  EXPECT_FALSE(torch::equal(other.generate(100, 50).images, x.images));
  // Far into a 60M-pair stream (and beyond) it still works and stays deterministic.
  for (int64_t n : {int64_t{59999999}, int64_t{1000000000000}})
    EXPECT_TRUE(torch::equal(a.generate(n, 3).digits, b.generate(n, 3).digits));
}

TEST(MultiMnistTest, EachSourceDigitComesFirstOncePerRoundInANewOrder) {
  const int64_t N = 50;
  MultiMnist gen(square_digits(N), 9);
  std::vector<int64_t> round0, round1;
  for (int64_t n = 0; n < N; ++n) round0.push_back(gen.example(n).source[0]);
  for (int64_t n = N; n < 2 * N; ++n) round1.push_back(gen.example(n).source[0]);
  auto sorted0 = round0, sorted1 = round1;
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_EQ(sorted0[i], i);
    EXPECT_EQ(sorted1[i], i);
  }
  EXPECT_NE(round0, round1);
}

TEST(MultiMnistTest, CompositeIsThePixelwiseMaxOfTheTwoShiftedDigits) {
  auto source = full_frame_digits(40);
  data::MultiMnistOptions max_overlay;
  max_overlay.overlay = data::Overlay::kMax;
  MultiMnist gen(source, 3, max_overlay);
  auto b = gen.generate(0, 64);
  EXPECT_TRUE(torch::equal(b.images, std::get<0>(b.digits.max(1))));
  for (int64_t n : {0, 5, 63}) {
    auto e = gen.example(n);
    for (int d = 0; d < 2; ++d) {
      // Digit d is its source image placed at (4 + dy, 4 + dx), zero elsewhere.
      auto expected = torch::zeros({36, 36});
      expected.narrow(0, 4 + e.dy[d], 28).narrow(1, 4 + e.dx[d], 28).copy_(
          source.images[e.source[d]].to(torch::kFloat) / 255);
      EXPECT_TRUE(torch::allclose(e.digits[d], expected)) << "example " << n << " digit " << d;
    }
  }
}

// The authors' generator adds the two uint8 digits and clips at 255: on [0, 1] floats clamp(a + b, 0, 1).
TEST(MultiMnistTest, AddClipOverlayIsTheClippedSumAndDiffersFromMaxWhereBothHaveInk) {
  auto source = testing::synthetic_set(40, 28, 5);
  EXPECT_EQ(data::MultiMnistOptions{}.overlay, data::Overlay::kAddClip);  // the default is the authors'
  MultiMnist add(source, 3);
  data::MultiMnistOptions max_options;
  max_options.overlay = data::Overlay::kMax;
  MultiMnist max(source, 3, max_options);
  auto a = add.generate(0, 64), m = max.generate(0, 64);
  // The overlay changes the composite only: the same pairs, shifts and single digits.
  EXPECT_TRUE(torch::equal(a.digits, m.digits));
  EXPECT_TRUE(torch::equal(a.labels, m.labels));
  auto d0 = a.digits.select(1, 0), d1 = a.digits.select(1, 1);  // [B, 1, S, S]
  EXPECT_TRUE(torch::equal(a.images, (d0 + d1).clamp(0, 1)));
  EXPECT_TRUE(torch::equal(m.images, torch::maximum(d0, d1)));  // max mode: the pre-option composite
  // Where only one digit has ink the two overlays agree; where both do, add is brighter unless the
  // max already saturates (then both are 1).
  auto both = (d0 > 0) & (d1 > 0), one = (d0 > 0) ^ (d1 > 0);
  ASSERT_GT(both.sum().item<int64_t>(), 100);  // strokes do cross in 64 pairs
  EXPECT_TRUE(torch::equal(a.images.masked_select(one), m.images.masked_select(one)));
  auto diff = (a.images - m.images).masked_select(both);
  EXPECT_GE(diff.min().item<float>(), 0.f);
  const auto unsaturated = m.images.masked_select(both) < 1;
  ASSERT_GT(unsaturated.sum().item<int64_t>(), 0);
  EXPECT_GT(diff.masked_select(unsaturated).min().item<float>(), 0.f);
  EXPECT_LE(a.images.max().item<float>(), 1.f);
  // example(n) uses the same overlay as generate().
  auto e = add.example(7);
  auto dsum = e.digits.sum(0).clamp_max(1);
  EXPECT_TRUE(torch::equal(e.image, dsum));
}

TEST(MultiMnistTest, BothOverlaysAreAPureFunctionOfSeedAndIndex) {
  auto source = testing::synthetic_set(40, 28, 5);
  for (auto overlay : {data::Overlay::kAddClip, data::Overlay::kMax}) {
    data::MultiMnistOptions o;
    o.overlay = overlay;
    MultiMnist g1(source, 11, o), g2(source, 11, o), other(source, 12, o);
    auto a = g1.generate(5, 20), b = g2.generate(5, 20);
    EXPECT_TRUE(torch::equal(a.images, b.images)) << data::overlay_name(overlay);
    EXPECT_TRUE(torch::equal(a.images.select(0, 3), g1.example(8).image.unsqueeze(0))) << data::overlay_name(overlay);
    EXPECT_FALSE(torch::equal(a.images, other.generate(5, 20).images)) << data::overlay_name(overlay);
  }
  EXPECT_EQ(data::parse_overlay("add"), data::Overlay::kAddClip);
  EXPECT_EQ(data::parse_overlay("max"), data::Overlay::kMax);
  EXPECT_STREQ(data::overlay_name(data::Overlay::kAddClip), "add");
  EXPECT_NE(error_of([] { data::parse_overlay("sum"); }).find("'add' or 'max'"), std::string::npos);
  data::MultiMnistOptions bad;
  bad.overlay = static_cast<data::Overlay>(7);
  EXPECT_NE(error_of([&] { MultiMnist g(source, 1, bad); }).find("overlay"), std::string::npos);
}

TEST(MultiMnistTest, ShiftsStayWithinFourPixelsAndNoInkLeavesTheCanvas) {
  auto source = full_frame_digits(30);
  MultiMnist gen(source, 8);
  std::set<int64_t> seen_dx, seen_dy;
  const auto coords = torch::arange(36, torch::kFloat);
  for (int64_t n = 0; n < 400; ++n) {
    auto e = gen.example(n);
    for (int d = 0; d < 2; ++d) {
      ASSERT_LE(std::abs(e.dx[d]), 4);
      ASSERT_LE(std::abs(e.dy[d]), 4);
      seen_dx.insert(e.dx[d]);
      seen_dy.insert(e.dy[d]);
      auto src = source.images[e.source[d]].to(torch::kFloat) / 255;  // [28, 28]
      auto dig = e.digits[d];                                          // [36, 36]
      const double mass = dig.sum().item<double>();
      ASSERT_NEAR(mass, src.sum().item<double>(), 1e-2) << "ink was clipped, example " << n;
      // The centroid moves by exactly (dx, dy) from the centred (padded) source.
      const double cx = (dig.sum(0) * coords).sum().item<double>() / mass;
      const double cy = (dig.sum(1) * coords).sum().item<double>() / mass;
      const double sx = (src.sum(0) * coords.narrow(0, 0, 28)).sum().item<double>() / mass + 4;
      const double sy = (src.sum(1) * coords.narrow(0, 0, 28)).sum().item<double>() / mass + 4;
      ASSERT_NEAR(cx - sx, e.dx[d], 1e-3);
      ASSERT_NEAR(cy - sy, e.dy[d], 1e-3);
    }
  }
  EXPECT_EQ(seen_dx.size(), 9u);  // the whole range -4..4 is used, not a narrower one
  EXPECT_EQ(seen_dy.size(), 9u);
}

TEST(MultiMnistTest, BoxOverlapOnHandMadeBoxes) {
  auto a = torch::zeros({10, 10}), b = torch::zeros({10, 10});
  a.narrow(0, 0, 4).narrow(1, 0, 4).fill_(1);  // rows 0..3, cols 0..3: area 16
  b.narrow(0, 2, 4).narrow(1, 2, 2).fill_(1);  // rows 2..5, cols 2..3: area 8; intersection rows 2..3 x cols 2..3 = 4
  auto o = data::box_overlap(a, b);
  ASSERT_TRUE(o.valid);
  EXPECT_DOUBLE_EQ(o.iou, 4.0 / (16 + 8 - 4));
  EXPECT_DOUBLE_EQ(o.over_smaller, 4.0 / 8);
  // Only the box counts, not the ink inside it.
  a[1][1] = 0;
  EXPECT_DOUBLE_EQ(data::box_overlap(a, b).iou, 4.0 / 20);
  EXPECT_FALSE(data::box_overlap(a, torch::zeros({10, 10})).valid);
  auto far = torch::zeros({10, 10});
  far[9][9] = 1;
  EXPECT_DOUBLE_EQ(data::box_overlap(a, far).iou, 0.0);
}

TEST(MultiMnistTest, OverlapStatisticMatchesItsExactExpectationOn20x20Boxes) {
  // Two 20x20 boxes shifted by independent (dx, dy) ~ U{-4..4}^2: enumerate all 9^4 cases.
  double e_iou = 0, e_small = 0;
  for (int dxa = -4; dxa <= 4; ++dxa)
    for (int dxb = -4; dxb <= 4; ++dxb)
      for (int dya = -4; dya <= 4; ++dya)
        for (int dyb = -4; dyb <= 4; ++dyb) {
          const double inter = (20.0 - std::abs(dxa - dxb)) * (20.0 - std::abs(dya - dyb));
          e_iou += inter / (800 - inter);
          e_small += inter / 400;
        }
  e_iou /= 6561;
  e_small /= 6561;
  MultiMnist gen(square_digits(100), 21);
  auto stats = data::overlap_stats(gen, 0, 4000);
  EXPECT_EQ(stats.examples, 4000);
  EXPECT_NEAR(stats.mean_iou(), e_iou, 0.01);
  EXPECT_NEAR(stats.mean_over_smaller(), e_small, 0.01);
  // The stated range of this generator on full 20x20 digits.
  EXPECT_GT(stats.mean_iou(), 0.55);
  EXPECT_LT(stats.mean_iou(), 0.65);
  EXPECT_GT(stats.mean_over_smaller(), 0.70);
  EXPECT_LT(stats.mean_over_smaller(), 0.76);
}

TEST(MultiMnistTest, BadArgumentsThrowClearly) {
  auto good = square_digits(20);
  auto one_class = good;
  one_class.labels = torch::full({20}, 3, torch::kLong);
  EXPECT_NE(error_of([&] { MultiMnist(one_class, 1); }).find("at least two classes"), std::string::npos);
  auto floats = good;
  floats.images = good.images.to(torch::kFloat);
  EXPECT_NE(error_of([&] { MultiMnist(floats, 1); }).find("uint8"), std::string::npos);
  auto not_square = good;
  not_square.images = torch::zeros({20, 28, 27}, torch::kUInt8);
  EXPECT_NE(error_of([&] { MultiMnist(not_square, 1); }).find("[20, 28, 27]"), std::string::npos);
  auto short_labels = good;
  short_labels.labels = good.labels.narrow(0, 0, 19);
  EXPECT_NE(error_of([&] { MultiMnist(short_labels, 1); }).find("N = 20"), std::string::npos);
  EXPECT_NE(error_of([&] { MultiMnist(good, 1, {4, 5}); }).find("got 5"), std::string::npos);
  EXPECT_NE(error_of([&] { MultiMnist(good, 1, {-1, 0}); }).find("got -1"), std::string::npos);
  MultiMnist gen(good, 1);
  EXPECT_NE(error_of([&] { gen.generate(-3, 2); }).find("got -3"), std::string::npos);
  EXPECT_NE(error_of([&] { gen.generate(0, 0); }).find("got 0"), std::string::npos);
  EXPECT_THROW(gen.example(-1), std::invalid_argument);
  EXPECT_THROW(gen.generate(std::numeric_limits<int64_t>::max(), 2), std::invalid_argument);
}

TEST(MultiMnistTest, TwoLongestCapsulesMetricOnHandMadeLengths) {
  auto lengths = torch::tensor({{0.1f, 0.9f, 0.2f, 0.8f},    // top-2 {1, 3}
                                {0.7f, 0.1f, 0.6f, 0.65f},   // top-2 {0, 3}
                                {0.05f, 0.3f, 0.95f, 0.2f},  // top-2 {2, 1}
                                {0.5f, 0.4f, 0.3f, 0.2f}});  // top-2 {0, 1}
  auto top = experiments::two_longest(lengths);
  EXPECT_TRUE(torch::equal(top, torch::tensor({{1, 3}, {0, 3}, {2, 1}, {0, 1}}, torch::kLong)));
  auto labels = torch::tensor({{3, 1}, {0, 2}, {1, 2}, {2, 3}}, torch::kLong);
  auto ok = experiments::both_found(lengths, labels);
  EXPECT_TRUE(torch::equal(ok, torch::tensor({true, false, true, false})));
  EXPECT_THROW(experiments::both_found(lengths, labels.narrow(0, 0, 3)), c10::Error);
  EXPECT_THROW(experiments::two_longest(torch::ones({3, 1})), c10::Error);

  using P = std::array<int64_t, 2>;
  EXPECT_EQ(experiments::align_to_labels(P{5, 3}, P{3, 5}), (P{3, 5}));
  EXPECT_EQ(experiments::align_to_labels(P{7, 3}, P{3, 5}), (P{3, 7}));
  EXPECT_EQ(experiments::align_to_labels(P{5, 7}, P{3, 5}), (P{7, 5}));
  EXPECT_EQ(experiments::align_to_labels(P{7, 8}, P{3, 5}), (P{7, 8}));
}

/// One intra-op thread while alive: the tiny models below are bound by per-op overhead, and on a
/// machine whose cores are busy OpenMP barriers across 2 threads made them 30x slower (measured 297 ms
/// with 1 thread vs 10.9 s with 2 under load 7 on 2 cores).
class OneThread {
 public:
  OneThread() : saved_(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(saved_); }

 private:
  int saved_;
};

/// 8x8 synthetic digits padded by 2 to the tiny model's 12x12 input.
struct TinySetup {
  MultiMnist train_pairs{testing::synthetic_set(200, 8, 1), 1, {2, 2}};
  MultiMnist test_pairs{testing::synthetic_set(100, 8, 2), 2, {2, 2}};
  models::CapsNetConfig config = testing::tiny_config();
};

// The tiny CapsNet for `steps` steps of `batch` pairs into out_dir, quietly, with no test pairs.
experiments::MultiMnistTrainOptions tiny_options(const std::string& out_dir, int64_t steps, int64_t batch) {
  experiments::MultiMnistTrainOptions o;
  o.model = testing::tiny_config();
  o.loop.out_dir = out_dir;
  o.loop.max_steps = steps;
  o.loop.batch_size = batch;
  o.loop.progress = false;
  o.test_size = 0;
  return o;
}

TEST(MultiMnistTrainTest, LossHasBothTermsFiniteGradientsAndDecreases) {
  OneThread one_thread;
  TinySetup s;
  torch::manual_seed(0);
  models::CapsNet model(s.config);
  auto batch = s.train_pairs.generate(0, 16);
  auto f = experiments::forward_pair(model, batch.images, batch.labels);
  ASSERT_EQ(f.reconstructions.sizes(), (std::vector<int64_t>{16, 2, 144}));
  auto loss = experiments::multimnist_loss(s.config, f, batch.labels, batch.digits);
  // Reconstruction term = 0.0005 * (SSE of digit a from capsule a + SSE of digit b from capsule b), batch mean.
  auto sse = (f.reconstructions - batch.digits.view({16, 2, 144})).pow(2).sum({1, 2}).mean();
  EXPECT_NEAR(loss.reconstruction.item<double>(), 0.0005 * sse.item<double>(), 1e-6);
  // Margin term: both classes are targets.
  auto targets = torch::zeros({16, 10});
  targets.scatter_(1, batch.labels, 1.0);
  EXPECT_NEAR(loss.margin.item<double>(), margin_loss_multi(f.out.lengths, targets).item<double>(), 1e-6);
  // The capsule of digit b is the one decoded second.
  auto rec_b = model->decode(f.out.digit_caps, batch.labels.select(1, 1));
  EXPECT_TRUE(torch::allclose(f.reconstructions.select(1, 1), rec_b));
  EXPECT_THROW(experiments::multimnist_loss(s.config, f, batch.labels.select(1, 0).unsqueeze(1).repeat({1, 2}),
                                      batch.digits),
               c10::Error);

  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<double> losses;
  for (int step = 0; step < 25; ++step) {
    auto g = experiments::forward_pair(model, batch.images, batch.labels);
    auto l = experiments::multimnist_loss(s.config, g, batch.labels, batch.digits);
    opt.zero_grad();
    l.total.backward();
    for (const auto& p : model->parameters()) {
      ASSERT_TRUE(p.grad().defined());
      ASSERT_TRUE(torch::isfinite(p.grad()).all().item<bool>());
    }
    losses.push_back(l.total.item<double>());
    opt.step();
  }
  EXPECT_LT(losses.back(), 0.7 * losses.front()) << losses.front() << " -> " << losses.back();
}

TEST(MultiMnistTrainTest, TrainWritesMetricsCheckpointAndEvaluates) {
  OneThread one_thread;
  TinySetup s;
  TempDir dir;
  auto o = tiny_options(dir / "run", 6, 8);
  o.loop.log_every = 3;
  o.test_size = 40;
  o.eval_batch_size = 16;
  std::ostringstream log;
  auto r = experiments::train_multimnist(o, s.train_pairs, &s.test_pairs, log);
  EXPECT_EQ(r.steps, 6);
  EXPECT_EQ(r.images_seen, 48);
  ASSERT_EQ(r.losses.size(), 6u);
  ASSERT_TRUE(r.test.has_value());
  EXPECT_EQ(r.test->examples, 40);
  EXPECT_GE(r.test->accuracy, 0.0);
  EXPECT_LE(r.test->accuracy, r.test->digit_accuracy + 1e-12);  // both found implies each found
  EXPECT_EQ(r.test->overlap.examples, 40);

  std::ifstream in(train::metrics_path(o.loop.out_dir));
  std::vector<std::string> events;
  for (std::string line; std::getline(in, line);) events.push_back(nlohmann::json::parse(line).at("event"));
  EXPECT_EQ(events, (std::vector<std::string>{"start", "train", "train", "checkpoint", "eval", "end"}));

  auto model = train::load_model(r.checkpoint);
  EXPECT_EQ(model->config.image_size, 12);
  auto again = experiments::evaluate_multimnist(model, s.test_pairs, 40, 16);
  EXPECT_DOUBLE_EQ(again.accuracy, r.test->accuracy);  // the checkpoint holds the evaluated weights

  // A generator whose canvas does not fit the model is refused by name.
  MultiMnist big(testing::synthetic_set(20, 28, 1), 1);
  EXPECT_NE(error_of([&] { experiments::train_multimnist(o, big, nullptr, log); }).find("36x36"), std::string::npos);
  o.loop.max_steps = 0;
  EXPECT_THROW(experiments::train_multimnist(o, s.train_pairs, nullptr, log), std::invalid_argument);
}

// MultiMNIST runs on the one loop, so it resumes exactly like `capsnet train`: 2 steps, a checkpoint,
// then 3 more from it give the losses and weights of 5 uninterrupted steps, bit for bit.
TEST(MultiMnistTrainTest, ResumeReproducesTheUninterruptedRunExactly) {
  OneThread one_thread;
  TinySetup s;
  TempDir dir;
  std::ostringstream log;
  auto options = [&](const std::string& out, int64_t steps) {
    auto o = tiny_options(dir / out, steps, 6);
    o.loop.lr = 3e-3;
    o.loop.seed = 5;
    return o;
  };
  auto full = experiments::train_multimnist(options("full", 5), s.train_pairs, nullptr, log);
  auto first = experiments::train_multimnist(options("part", 2), s.train_pairs, nullptr, log);
  auto rest_options = options("rest", 5);
  rest_options.loop.resume = first.checkpoint;
  auto rest = experiments::train_multimnist(rest_options, s.train_pairs, nullptr, log);
  ASSERT_EQ(full.losses.size(), 5u);
  ASSERT_EQ(rest.losses.size(), 3u);
  EXPECT_EQ(rest.steps, 5);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(first.losses[i], full.losses[i]) << "step " << i;
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.losses[i], full.losses[i + 2]) << "step " << i + 2;
  auto a = train::load_model(full.checkpoint), b = train::load_model(rest.checkpoint);
  auto pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;

  // A resume with options that change the batch sequence is refused by name.
  auto changed = options("changed", 5);
  changed.loop.resume = first.checkpoint;
  changed.loop.batch_size = 7;
  EXPECT_NE(error_of([&] { experiments::train_multimnist(changed, s.train_pairs, nullptr, log); }).find("batch_size"),
            std::string::npos);
  // So is a checkpoint of another task's model.
  auto other = options("other", 5);
  other.loop.resume = first.checkpoint;
  other.model.routing_iterations = s.config.routing_iterations + 1;
  EXPECT_NE(error_of([&] { experiments::train_multimnist(other, s.train_pairs, nullptr, log); }).find("does not match"),
            std::string::npos);
}

// The checkpoint records the overlay in its train_generator; checkpoints from before the option have
// no key and were trained with max, which is what a max run still writes, so they resume with max only.
TEST(MultiMnistTrainTest, ResumeWithAnotherOverlayIsRefusedAndOldCheckpointsReadAsMax) {
  OneThread one_thread;
  TempDir dir;
  std::ostringstream log;
  auto source = testing::synthetic_set(200, 8, 1);
  data::MultiMnistOptions add_options{2, 2}, max_options{2, 2};
  max_options.overlay = data::Overlay::kMax;
  MultiMnist add_pairs(source, 1, add_options), max_pairs(source, 1, max_options);
  auto options = [&](const std::string& out, int64_t steps, const std::string& resume) {
    auto o = tiny_options(dir / out, steps, 4);
    o.loop.resume = resume;
    return o;
  };
  auto with_add = experiments::train_multimnist(options("add", 1, ""), add_pairs, nullptr, log);
  auto with_max = experiments::train_multimnist(options("max", 1, ""), max_pairs, nullptr, log);
  const auto add_meta = train::read_checkpoint_meta(with_add.checkpoint);
  const auto max_meta = train::read_checkpoint_meta(with_max.checkpoint);
  EXPECT_EQ(add_meta.train_options.at("train_generator").at("overlay"), "add");
  EXPECT_FALSE(max_meta.train_options.at("train_generator").contains("overlay"));  // the old format
  EXPECT_EQ(experiments::saved_overlay(add_meta.train_options), data::Overlay::kAddClip);
  EXPECT_EQ(experiments::saved_overlay(max_meta.train_options), data::Overlay::kMax);
  EXPECT_EQ(experiments::saved_overlay(nlohmann::json::object()), data::Overlay::kMax);

  auto refused = error_of([&] { experiments::train_multimnist(options("r1", 2, with_add.checkpoint), max_pairs, nullptr, log); });
  EXPECT_NE(refused.find("train_generator"), std::string::npos) << refused;
  refused = error_of([&] { experiments::train_multimnist(options("r2", 2, with_max.checkpoint), add_pairs, nullptr, log); });
  EXPECT_NE(refused.find("train_generator"), std::string::npos) << refused;
  EXPECT_EQ(experiments::train_multimnist(options("r3", 2, with_max.checkpoint), max_pairs, nullptr, log).steps, 2);
  EXPECT_EQ(experiments::train_multimnist(options("r4", 2, with_add.checkpoint), add_pairs, nullptr, log).steps, 2);
}

TEST(MultiMnistCnnTest, LossIsBinaryCrossEntropyPerClassSummedAndAveragedOverTheBatch) {
  // Two examples, K = 3. Example 0 has classes {0, 2}, example 1 has {1, 2}.
  auto logits = torch::tensor({{0.0, 1.0, -1.0}, {2.0, -0.5, 0.25}}, torch::kFloat64).requires_grad_();
  auto labels = torch::tensor({{0, 2}, {2, 1}}, torch::kLong);
  auto loss = experiments::multimnist_cnn_loss(logits, labels);
  const auto softplus = [](double x) { return std::log1p(std::exp(x)); };  // -log sigmoid(-x)
  // Target 1: -log sigmoid(z) = softplus(-z); target 0: -log(1 - sigmoid(z)) = softplus(z).
  const double ex0 = softplus(-0.0) + softplus(1.0) + softplus(1.0);
  const double ex1 = softplus(2.0) + softplus(0.5) + softplus(-0.25);
  EXPECT_NEAR(loss.item<double>(), (ex0 + ex1) / 2, 1e-12);
  loss.backward();
  // d/dz = (sigmoid(z) - t) / B.
  auto t = torch::tensor({{1.0, 0.0, 1.0}, {0.0, 1.0, 1.0}}, torch::kFloat64);
  EXPECT_TRUE(torch::allclose(logits.grad(), (torch::sigmoid(logits.detach()) - t) / 2, 0, 1e-12));
  EXPECT_THROW(experiments::multimnist_cnn_loss(logits, torch::tensor({{1, 1}, {0, 2}}, torch::kLong)), c10::Error);
  EXPECT_THROW(experiments::multimnist_cnn_loss(logits, torch::tensor({0, 2}, torch::kLong)), c10::Error);
  EXPECT_EQ(experiments::parse_multimnist_model("cnn"), experiments::MultiMnistModel::kCnn);
  EXPECT_NE(error_of([] { experiments::parse_multimnist_model("resnet"); }).find("resnet"), std::string::npos);
}

TEST(MultiMnistCnnTest, TrainsEvaluatesEveryNStepsAndItsCheckpointHoldsTheEvaluatedWeights) {
  OneThread one_thread;
  TinySetup s;
  TempDir dir;
  auto o = tiny_options(dir / "run", 30, 16);
  o.which = experiments::MultiMnistModel::kCnn;
  o.cnn = testing::tiny_cnn_config(12);
  o.loop.lr = 3e-3;
  o.loop.log_every = 10;
  o.loop.eval_every = 10;
  o.test_size = 40;
  o.eval_batch_size = 16;
  std::ostringstream log;
  auto r = experiments::train_multimnist(o, s.train_pairs, &s.test_pairs, log);
  EXPECT_EQ(r.steps, 30);
  ASSERT_TRUE(r.test.has_value());
  EXPECT_EQ(r.test->examples, 40);
  EXPECT_LE(r.test->accuracy, r.test->digit_accuracy + 1e-12);
  // The loss falls: mean of the last 10 steps below that of the first 10 (new pairs every step).
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += r.losses[i], last += r.losses[20 + i];
  EXPECT_LT(last, first) << log.str();
  // A learning curve: eval records at steps 10, 20 and 30, each with the error.
  std::ifstream in(train::metrics_path(o.loop.out_dir));
  std::vector<int64_t> eval_steps;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.at("event") == "start") EXPECT_EQ(j.at("task"), "multimnist-cnn");
    if (j.at("event") != "eval") continue;
    eval_steps.push_back(j.at("step").get<int64_t>());
    EXPECT_NEAR(j.at("error").get<double>(), 1 - j.at("accuracy").get<double>(), 1e-12);
  }
  EXPECT_EQ(eval_steps, (std::vector<int64_t>{10, 20, 30}));
  // The checkpoint holds the evaluated weights.
  models::BaselineCnn cnn(o.cnn);
  train::load_checkpoint(r.checkpoint, *cnn, nullptr,
                         [&](const nlohmann::json& saved) { return saved == o.cnn.to_json(); });
  auto again = experiments::evaluate_multimnist(cnn, s.test_pairs, 40, 16);
  EXPECT_DOUBLE_EQ(again.accuracy, r.test->accuracy);
  EXPECT_DOUBLE_EQ(again.loss, r.test->loss);
  // A CNN whose input does not fit the canvas is refused by name.
  o.cnn.image_size = 28;
  EXPECT_NE(error_of([&] { experiments::train_multimnist(o, s.train_pairs, nullptr, log); }).find("12x12"),
            std::string::npos);
}

TEST(MultiMnistVizTest, PanelAndFigureHaveTheDocumentedSizeAndDecode) {
  OneThread one_thread;
  auto image = torch::rand({36, 36}), recs = torch::rand({2, 36, 36});
  auto panel = experiments::multimnist_panel(image, recs, {3, 5}, {3, 5}, 2);
  // caption 5*2+4 = 14 rows, then 3 images of 72 px with 2 px gaps.
  ASSERT_EQ(panel.size(0), 14 + 72);
  ASSERT_EQ(panel.size(1), 3 * 72 + 2 * 2);
  EXPECT_GT(panel.narrow(0, 0, 14).sum().item<float>(), 0.0f);  // a caption was drawn
  EXPECT_FLOAT_EQ(panel[14][0].item<float>(), image[0][0].item<float>());
  EXPECT_FLOAT_EQ(panel[14 + 71][74 + 71].item<float>(), recs[0][35][35].item<float>());
  EXPECT_FLOAT_EQ(panel[14][148].item<float>(), recs[1][0][0].item<float>());

  TinySetup s;
  torch::manual_seed(0);
  models::CapsNet model(s.config);
  // Untrained, so nearly every pair is misclassified: ask for 5 of those, 3 panels per row.
  auto figure = experiments::multimnist_figure(model, s.test_pairs, 0, 5, 3, 100);
  // Tiny canvas 12 -> 24 px images; "R:(a,b) L:(a,b)" is 118 px at scale 2, more than the 76 px panel,
  // so the caption uses scale 1: 5 + 4 rows.
  const int64_t panel_h = 5 + 4 + 24, panel_w = 3 * 24 + 2 * 2;
  EXPECT_EQ(figure.size(0), 2 * (panel_h + 4) + 4);
  EXPECT_EQ(figure.size(1), 3 * (panel_w + 4) + 4);
  TempDir dir;
  viz::write_png_gray(dir / "m.png", figure);
  auto back = viz::read_png_gray(dir / "m.png");
  EXPECT_EQ(back.sizes(), figure.sizes());

  EXPECT_THROW(experiments::multimnist_figure(model, s.test_pairs, 0, 0), std::invalid_argument);
  auto no_decoder = s.config;
  no_decoder.reconstruction = false;
  models::CapsNet plain(no_decoder);
  EXPECT_THROW(experiments::multimnist_figure(plain, s.test_pairs, 3, 0), std::invalid_argument);
}

TEST(MultiMnistCliTest, TrainThenEvalOnlyOnGeneratedIdxFiles) {
  const testing::CliFolder run("run");
  const std::string& out = run.out;
  testing::write_fake_mnist(run.data, 60, 30);
  // A narrow model (4 conv1 channels, 2 capsule types) keeps the 36x36 pipeline fast.
  const auto multimnist = [&](const std::string& args) {
    return run.run("multimnist", "--test-size 20 --conv1-channels 4 --primary-types 2 " + args);
  };
  auto trained = multimnist("--steps 2 --batch-size 4 --figure-correct 0 --figure-wrong 2");
  ASSERT_EQ(trained.status, 0) << trained.output;
  EXPECT_NE(trained.output.find("MultiMNIST test: error"), std::string::npos) << trained.output;
  std::ifstream in(out + "/multimnist.json");
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("steps"), 2);
  EXPECT_EQ(j.at("images_seen"), 8);
  EXPECT_EQ(j.at("test_examples"), 20);
  EXPECT_EQ(j.at("model").at("image_size"), 36);
  EXPECT_NEAR(j.at("error").get<double>(), 1 - j.at("accuracy").get<double>(), 1e-12);
  EXPECT_GT(j.at("overlap").at("mean_iou").get<double>(), 0.0);
  EXPECT_LE(j.at("overlap").at("mean_iou").get<double>(), j.at("overlap").at("mean_over_smaller").get<double>());
  // Two panels of [5*2+4 + 72, 3*72 + 4] in one row, 4 px padding.
  auto png = viz::read_png_gray(out + "/multimnist.png");
  EXPECT_EQ(png.size(0), 14 + 72 + 8);
  EXPECT_EQ(png.size(1), 2 * (220 + 4) + 4);
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint.pt"));
  EXPECT_TRUE(std::filesystem::exists(out + "/metrics.jsonl"));

  // --eval-only on the same fixed test pairs reproduces the error of the trained weights.
  auto evaluated = multimnist("--eval-only --figure-correct 0 --figure-wrong 0");
  ASSERT_EQ(evaluated.status, 0) << evaluated.output;
  std::ifstream in2(out + "/multimnist.json");
  auto k = nlohmann::json::parse(in2);
  EXPECT_EQ(k.at("mode"), "eval-only");
  EXPECT_EQ(k.at("steps"), 2);
  EXPECT_DOUBLE_EQ(k.at("error").get<double>(), j.at("error").get<double>());
  // In the precision the run's own evaluation computed in (--precision, auto for both): the same loss to the
  // last bit, not only the same error.
  EXPECT_EQ(k.at("precision"), j.at("precision"));
  EXPECT_DOUBLE_EQ(k.at("test_loss").get<double>(), j.at("test_loss").get<double>());
  ASSERT_EQ(multimnist("--eval-only --precision fp32 --figure-correct 0 --figure-wrong 0").status, 0);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(out + "/multimnist.json")).at("precision"), "fp32");

  auto wrong = multimnist("--checkpoint " + out + "/checkpoint.pt");
  EXPECT_EQ(wrong.status, 1);
  EXPECT_NE(wrong.output.find("only read with --eval-only"), std::string::npos) << wrong.output;
  EXPECT_EQ(j.at("overlay"), "add");  // the default, the authors' overlay
  EXPECT_EQ(k.at("overlay"), "add");  // --eval-only takes the checkpoint's

  auto foo = multimnist("--steps 1 --overlay foo");
  EXPECT_TRUE(testing::FailsSaying(foo, "--overlay"));
  EXPECT_NE(foo.output.find("foo"), std::string::npos) << foo.output;
  // Resuming the add-overlay checkpoint on max pairs is refused, naming the generator.
  EXPECT_TRUE(testing::FailsSaying(
      run.run_to(
          out + "2", "multimnist",
          "--test-size 20 --conv1-channels 4 --primary-types 2 --steps 3 --batch-size 4 --overlay max --resume " + out +
              "/checkpoint.pt --figure-correct 0 --figure-wrong 0"),
      "train_generator"));

  // The baseline CNN: same pairs, its own metric line, a learning curve, and --eval-only knows it.
  const std::string cnn_out = run.dir / "cnn";
  const auto cnn_run = [&](const std::string& args) {
    return run.run_to(cnn_out, "multimnist", "--test-size 20 " + args);
  };
  auto cnn = cnn_run("--model cnn --steps 2 --batch-size 4 --eval-every 1");
  ASSERT_EQ(cnn.status, 0) << cnn.output;
  EXPECT_NE(cnn.output.find("two largest logits"), std::string::npos) << cnn.output;
  EXPECT_NE(cnn.output.find("step 1 (epoch"), std::string::npos) << cnn.output;
  EXPECT_NE(cnn.output.find("no figure"), std::string::npos) << cnn.output;
  std::ifstream in3(cnn_out + "/multimnist.json");
  auto c = nlohmann::json::parse(in3);
  EXPECT_EQ(c.at("model_kind"), "cnn");
  EXPECT_EQ(c.at("model").at("image_size"), 36);
  EXPECT_FALSE(std::filesystem::exists(cnn_out + "/multimnist.png"));
  auto cnn_eval = cnn_run("--eval-only");
  ASSERT_EQ(cnn_eval.status, 0) << cnn_eval.output;
  std::ifstream in4(cnn_out + "/multimnist.json");
  auto ce = nlohmann::json::parse(in4);
  EXPECT_EQ(ce.at("model_kind"), "cnn");
  EXPECT_DOUBLE_EQ(ce.at("error").get<double>(), c.at("error").get<double>());
  EXPECT_TRUE(testing::FailsSaying(cnn_run("--eval-only --model cnn"), "--model is not read with --eval-only"));
}

TEST(MultiMnistCliTest, EvalOnlyReadsExportedWeightFiles) {
  const testing::CliFolder run("run");
  testing::write_fake_mnist(run.data, 60, 30);
  const auto multimnist = [&](const std::string& out, const std::string& args) {
    return run.run_to(out, "multimnist", "--test-size 20 --figure-correct 0 --figure-wrong 0 " + args);
  };
  const auto summary = [](const std::string& out) {
    std::ifstream in(out + "/multimnist.json");
    return nlohmann::json::parse(in);
  };
  // A CapsNet trained on max-overlay pairs, exported (fp32): --eval-only on the weight file takes the
  // overlay, steps and batch size from the card and scores exactly what the checkpoint scores.
  const std::string out = run.out, weights = run.dir / "caps.pt";
  ASSERT_EQ(multimnist(out, "--conv1-channels 4 --primary-types 2 --steps 3 --batch-size 4 --overlay max").status, 0);
  auto exported = testing::run_cli("export --checkpoint " + out + "/checkpoint.pt --out " + weights);
  ASSERT_EQ(exported.status, 0) << exported.output;
  const std::string from_weights = run.dir / "eval-weights";
  auto evaluated = multimnist(from_weights, "--eval-only --checkpoint " + weights);
  ASSERT_EQ(evaluated.status, 0) << evaluated.output;
  auto w = summary(from_weights);
  EXPECT_EQ(w.at("mode"), "eval-only");
  EXPECT_EQ(w.at("overlay"), "max");  // from the card's train_options, not --overlay's default (add)
  EXPECT_EQ(w.at("steps"), 3);
  EXPECT_EQ(w.at("images_seen"), 12);
  EXPECT_EQ(w.at("model_kind"), "capsnet");
  const std::string from_ckpt = run.dir / "eval-ckpt";
  ASSERT_EQ(multimnist(from_ckpt, "--eval-only --checkpoint " + out + "/checkpoint.pt").status, 0);
  auto c = summary(from_ckpt);
  EXPECT_EQ(c.at("overlay"), "max");
  EXPECT_DOUBLE_EQ(w.at("error").get<double>(), c.at("error").get<double>());
  EXPECT_DOUBLE_EQ(w.at("test_loss").get<double>(), c.at("test_loss").get<double>());
  EXPECT_DOUBLE_EQ(w.at("overlap").at("mean_iou").get<double>(), c.at("overlap").at("mean_iou").get<double>());
  // --overlay still overrides the card.
  ASSERT_EQ(multimnist(from_weights, "--eval-only --overlay add --checkpoint " + weights).status, 0);
  EXPECT_EQ(summary(from_weights).at("overlay"), "add");
  // Re-exporting the weight file keeps the training options.
  const std::string again = run.dir / "again.pt";
  ASSERT_EQ(testing::run_cli("export --checkpoint " + weights + " --out " + again).status, 0);
  ASSERT_EQ(multimnist(from_weights, "--eval-only --checkpoint " + again).status, 0);
  EXPECT_EQ(summary(from_weights).at("overlay"), "max");

  // The baseline CNN's weight file is recognised as the CNN.
  const std::string cnn_out = run.dir / "cnn", cnn_weights = run.dir / "cnn.pt";
  ASSERT_EQ(multimnist(cnn_out, "--model cnn --steps 2 --batch-size 4").status, 0);
  ASSERT_EQ(testing::run_cli("export --checkpoint " + cnn_out + "/checkpoint.pt --out " + cnn_weights).status, 0);
  const std::string cnn_eval = run.dir / "cnn-eval";
  ASSERT_EQ(multimnist(cnn_eval, "--eval-only --checkpoint " + cnn_weights).status, 0);
  auto ce = summary(cnn_eval);
  EXPECT_EQ(ce.at("model_kind"), "cnn");
  EXPECT_EQ(ce.at("overlay"), "add");
  EXPECT_DOUBLE_EQ(ce.at("error").get<double>(), summary(cnn_out).at("error").get<double>());

  // A weight file of a 28x28 MNIST CapsNet: one line saying the sizes.
  const std::string mnist_out = run.dir / "mnist", mnist_weights = run.dir / "mnist.pt";
  ASSERT_EQ(run.run_to(mnist_out, "train", "--epochs 1 --train-limit 8 --test-limit 8 --batch-size 4 "
                                           "--conv1-channels 4 --primary-types 2")
                .status,
            0);
  ASSERT_EQ(testing::run_cli("export --checkpoint " + mnist_out + "/checkpoint.pt --out " + mnist_weights).status, 0);
  EXPECT_TRUE(testing::FailsSaying(multimnist(run.dir / "bad", "--eval-only --checkpoint " + mnist_weights),
                                   "the model takes 1x28x28 images, MultiMNIST pairs are 1x36x36"));
}

}  // namespace
}  // namespace capsnet
