// Convolutional capsules (SegCaps layers), the cluttered-digit segmentation data, the SegCaps model and
// the `capsnet segcaps` command. Run alone: capsnet_tests --gtest_filter='SegCaps*'
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "capsnet/data/mnist.h"
#include "capsnet/data/segmentation.h"
#include "capsnet/models/segcaps.h"
#include "capsnet/nn/capsule_conv.h"
#include "apps/experiments/segcaps.h"
#include "gradcheck.h"
#include "cli_helpers.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace {

using capsnet::nn::CapsuleConv2d;
using capsnet::nn::CapsuleConv2dOptions;
using capsnet::nn::CapsuleConvTranspose2d;
using capsnet::nn::CapsuleConvTranspose2dOptions;
using capsnet::testing::ScopedThreads;
namespace cdetail = capsnet::nn::detail;

using capsnet::testing::FailsSaying;

// Expects `fn` to throw std::invalid_argument whose message contains `needle`.
template <class Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected std::invalid_argument containing '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

struct Grads {
  torch::Tensor v, du, dw, db;
};

// Runs forward through `fn`, backpropagates sum(v * R), returns value and the gradients.
template <class Fn>
Grads run_with_grads(Fn&& fn, const torch::Tensor& u, const torch::Tensor& w, const torch::Tensor& b,
                     const torch::Tensor& R) {
  for (auto t : {u, w, b})
    if (t.grad().defined()) t.mutable_grad().zero_();
  auto v = fn();
  (v * R).sum().backward();
  Grads g{v.detach().clone(), u.grad().clone(), w.grad().clone(), b.grad().clone()};
  for (auto t : {u, w, b}) t.mutable_grad().zero_();
  return g;
}

// Fast (fused and composite routing) vs the loop reference for one layer, values and gradients.
template <class Layer>
void check_layer_against_reference(Layer& layer, const std::vector<int64_t>& input_shape, torch::Dtype dtype,
                                   double tol) {
  layer->to(dtype);
  auto u = torch::randn(input_shape, torch::TensorOptions().dtype(dtype)).requires_grad_();
  auto routing = layer->options.routing();
  auto geometry = layer->geometry();
  const auto R = torch::randn(layer->forward(u).sizes(), torch::TensorOptions().dtype(dtype));
  auto ref = run_with_grads([&] { return cdetail::reference_capsule_conv(u, layer->weight, layer->bias, geometry, routing); },
                       u, layer->weight, layer->bias, R);
  for (bool fused : {true, false}) {
    layer->options.routing().fused = fused;
    auto fast = run_with_grads([&] { return layer->forward(u); }, u, layer->weight, layer->bias, R);
    SCOPED_TRACE(fused ? "fused routing" : "composite routing");
    EXPECT_TRUE(torch::allclose(fast.v, ref.v, tol, tol)) << (fast.v - ref.v).abs().max();
    EXPECT_TRUE(torch::allclose(fast.du, ref.du, tol, tol)) << (fast.du - ref.du).abs().max();
    EXPECT_TRUE(torch::allclose(fast.dw, ref.dw, tol, tol)) << (fast.dw - ref.dw).abs().max();
    EXPECT_TRUE(torch::allclose(fast.db, ref.db, tol, tol)) << (fast.db - ref.db).abs().max();
    EXPECT_GT(fast.dw.abs().sum().template item<double>(), 0);  // the check compared real gradients
  }
}

}  // namespace

// ---- layers -------------------------------------------------------------------------------------

TEST(SegCapsConv, ConvMatchesReferenceValuesAndGradients) {
  ScopedThreads one(1);
  torch::manual_seed(1);
  struct Case {
    int64_t k, s, p, r;
    bool share, grad_through;
  };
  for (const auto& c : {Case{3, 1, 1, 3, false, true}, Case{3, 2, 0, 2, false, false}, Case{3, 2, 1, 1, true, true},
                        Case{1, 1, 0, 3, true, false}}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      SCOPED_TRACE(testing::Message() << "k" << c.k << " s" << c.s << " p" << c.p << " r" << c.r << " share "
                                      << c.share << " grad_through " << c.grad_through << " " << dtype);
      CapsuleConv2d layer(CapsuleConv2dOptions(2, 3, 3, 4)
                              .kernel_size(c.k)
                              .stride(c.s)
                              .padding(c.p)
                              .routing({c.r, c.grad_through})
                              .share_across_types(c.share)
                              .weight_std(0.5));
      {
        torch::NoGradGuard g;
        layer->bias.normal_(0, 0.1);
      }
      check_layer_against_reference(layer, {2, 2, 3, 5, 5}, dtype, dtype == torch::kDouble ? 1e-9 : 2e-4);
    }
  }
}

TEST(SegCapsConv, TransposedMatchesReferenceValuesAndGradients) {
  ScopedThreads one(1);
  torch::manual_seed(2);
  struct Case {
    int64_t k, s, p, op, r;
    bool share;
  };
  for (const auto& c : {Case{4, 2, 1, 0, 3, false}, Case{3, 2, 1, 1, 2, true}, Case{3, 1, 0, 0, 1, false}}) {
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      SCOPED_TRACE(testing::Message() << "k" << c.k << " s" << c.s << " p" << c.p << " op" << c.op << " r" << c.r
                                      << " " << dtype);
      CapsuleConvTranspose2d layer(CapsuleConvTranspose2dOptions(3, 2, 2, 3)
                                       .kernel_size(c.k)
                                       .stride(c.s)
                                       .padding(c.p)
                                       .output_padding(c.op)
                                       .routing({c.r})
                                       .share_across_types(c.share)
                                       .weight_std(0.5));
      {
        torch::NoGradGuard g;
        layer->bias.normal_(0, 0.1);
      }
      check_layer_against_reference(layer, {2, 3, 2, 3, 4}, dtype, dtype == torch::kDouble ? 1e-9 : 2e-4);
    }
  }
}

TEST(SegCapsConv, ReferencePredictionsMatchAHandComputedValue) {
  // One child type, one atom, one parent of one atom, 3x3 kernel of ones, padding 1: each prediction is
  // the sum of the 3x3 neighbourhood (a box filter), checked at a corner and in the middle.
  auto u = torch::arange(16, torch::kDouble).view({1, 1, 1, 4, 4});
  auto w = torch::ones({1, 1, 1, 1, 3, 3}, torch::kDouble);
  auto u_hat = cdetail::reference_capsule_predictions(u, w, {}, {1, 1, 0, false});
  ASSERT_EQ(u_hat.sizes(), (std::vector<int64_t>{1, 1, 1, 1, 4, 4}));
  EXPECT_DOUBLE_EQ(u_hat[0][0][0][0][0][0].item<double>(), 0 + 1 + 4 + 5);
  EXPECT_DOUBLE_EQ(u_hat[0][0][0][0][1][1].item<double>(), 0 + 1 + 2 + 4 + 5 + 6 + 8 + 9 + 10);
  // And the layer's grouped convolution agrees with it.
  CapsuleConv2d layer(CapsuleConv2dOptions(1, 1, 1, 1).kernel_size(3).padding(1).bias(false));
  layer->to(torch::kDouble);
  {
    torch::NoGradGuard g;
    layer->weight.fill_(1);
  }
  EXPECT_TRUE(torch::allclose(layer->predictions(u), u_hat));
}

TEST(SegCapsConv, OneIterationIsUniformCoupling) {
  // r = 1: c = 1/T_out for every child, so v_j = squash(sum_i u_hat_{j|i} / T_out) at every position.
  torch::manual_seed(3);
  CapsuleConv2d layer(CapsuleConv2dOptions(3, 2, 4, 5).kernel_size(3).padding(1).routing({1}));
  auto u = torch::randn({2, 3, 2, 4, 4});
  auto u_hat = layer->predictions(u);  // [B, T_in, T_out, A_out, H, W]
  auto expected = capsnet::squash(u_hat.sum(1) / 4.0, /*dim=*/2);
  EXPECT_TRUE(torch::allclose(layer->forward(u), expected, 1e-5, 1e-6));
}

TEST(SegCapsConv, Float64GradcheckConv) {
  torch::manual_seed(4);
  for (bool fused : {true, false}) {
    CapsuleConv2d layer(CapsuleConv2dOptions(2, 2, 2, 3).kernel_size(3).stride(2).padding(1)
                            .routing({3, true, fused})
                            .weight_std(0.7));
    layer->to(torch::kDouble);
    {
      torch::NoGradGuard g;
      layer->bias.normal_(0, 0.2);
    }
    auto u = torch::randn({1, 2, 2, 3, 3}, torch::kDouble).requires_grad_();
    EXPECT_TRUE(capsnet::testing::gradcheck([&](const std::vector<torch::Tensor>& in) { return layer->forward(in[0]); },
                                             {u, layer->weight, layer->bias}))
        << (fused ? "fused" : "composite");
  }
}

TEST(SegCapsConv, Float64GradcheckTransposed) {
  torch::manual_seed(5);
  CapsuleConvTranspose2d layer(CapsuleConvTranspose2dOptions(2, 2, 2, 2).routing({2}).weight_std(0.7));
  layer->to(torch::kDouble);
  {
    torch::NoGradGuard g;
    layer->bias.normal_(0, 0.2);
  }
  auto u = torch::randn({1, 2, 2, 2, 2}, torch::kDouble).requires_grad_();
  EXPECT_TRUE(capsnet::testing::gradcheck([&](const std::vector<torch::Tensor>& in) { return layer->forward(in[0]); },
                                           {u, layer->weight, layer->bias}));
}

TEST(SegCapsConv, OutputShapes) {
  auto shape = [](auto layer, std::vector<int64_t> in) { return layer->forward(torch::randn(in)).sizes().vec(); };
  using V = std::vector<int64_t>;
  EXPECT_EQ(shape(CapsuleConv2d(CapsuleConv2dOptions(2, 3, 4, 5)), V{2, 2, 3, 8, 8}), (V{2, 4, 5, 8, 8}));
  EXPECT_EQ(shape(CapsuleConv2d(CapsuleConv2dOptions(2, 3, 4, 5).kernel_size(3).stride(2).padding(1)), V{1, 2, 3, 8, 7}),
            (V{1, 4, 5, 4, 4}));
  EXPECT_EQ(shape(CapsuleConv2d(CapsuleConv2dOptions(1, 3, 2, 2).kernel_size(3).padding(0)), V{1, 1, 3, 7, 6}),
            (V{1, 2, 2, 5, 4}));
  // Transposed with the defaults (4x4, stride 2, padding 1) doubles both sides.
  EXPECT_EQ(shape(CapsuleConvTranspose2d(CapsuleConvTranspose2dOptions(2, 3, 4, 5)), V{2, 2, 3, 4, 5}),
            (V{2, 4, 5, 8, 10}));
  EXPECT_EQ(shape(CapsuleConvTranspose2d(CapsuleConvTranspose2dOptions(2, 3, 1, 2).kernel_size(3).padding(1).output_padding(1)),
                  V{1, 2, 3, 3, 3}),
            (V{1, 1, 2, 6, 6}));
  EXPECT_EQ(cdetail::capsule_conv_output_size(5, 3, {2, 1, 1, true}), 10);
  EXPECT_EQ(cdetail::capsule_conv_output_size(9, 5, {2, 2, 0, false}), 5);
}

TEST(SegCapsConv, BadInputAndOptions) {
  CapsuleConv2d conv(CapsuleConv2dOptions(2, 3, 4, 5));
  expect_invalid([&] { conv->forward(torch::randn({2, 6, 8, 8})); }, "5 dims");
  expect_invalid([&] { conv->forward(torch::randn({2, 3, 3, 8, 8})); }, "capsule types");
  expect_invalid([&] { conv->forward(torch::randn({2, 2, 4, 8, 8})); }, "atoms");
  expect_invalid([&] { conv->forward(torch::ones({2, 2, 3, 8, 8}, torch::kLong)); }, "floating point");
  CapsuleConv2d valid(CapsuleConv2dOptions(2, 3, 4, 5).padding(0));
  expect_invalid([&] { valid->forward(torch::randn({1, 2, 3, 4, 8})); }, "too small");
  CapsuleConvTranspose2d deconv(CapsuleConvTranspose2dOptions(2, 3, 4, 5));
  expect_invalid([&] { deconv->forward(torch::randn({1, 2, 3, 4})); }, "5 dims");
  expect_invalid([&] { deconv->forward(torch::randn({1, 2, 5, 4, 4})); }, "A_in = 3");
  expect_invalid([] { CapsuleConv2d(CapsuleConv2dOptions(2, 3, 4, 5).kernel_size(0)); }, "kernel_size");
  expect_invalid([] { CapsuleConv2d(CapsuleConv2dOptions(0, 3, 4, 5)); }, "in_types");
  expect_invalid([] { CapsuleConv2d(CapsuleConv2dOptions(2, 3, 4, 5).routing({0})); }, "routing iterations");
  expect_invalid([] { CapsuleConvTranspose2d(CapsuleConvTranspose2dOptions(2, 3, 4, 5).output_padding(2)); },
                 "output_padding");
  expect_invalid([] { capsnet::nn::local_routing(torch::randn({2, 3, 4, 5}), {}); }, "6 dims");
}

// ---- data ---------------------------------------------------------------------------------------

namespace {
capsnet::data::ImageSet tiny_digits(int64_t n, uint64_t seed) { return capsnet::testing::synthetic_set(n, 28, seed); }
}  // namespace

TEST(SegCapsData, DeterministicBatchConsistentAndSeeded) {
  capsnet::data::DigitSegmentation a(tiny_digits(20, 1), 7), b(tiny_digits(20, 1), 7), c(tiny_digits(20, 1), 8);
  auto x = a.generate(0, 8), y = b.generate(0, 8), z = c.generate(0, 8);
  EXPECT_TRUE(torch::equal(x.images, y.images));
  EXPECT_TRUE(torch::equal(x.masks, y.masks));
  EXPECT_FALSE(torch::equal(x.images, z.images));
  auto tail = a.generate(5, 3);  // examples 5..7 alone equal the same examples in a larger batch
  EXPECT_TRUE(torch::equal(tail.images, x.images.narrow(0, 5, 3)));
  EXPECT_TRUE(torch::equal(tail.labels, x.labels.narrow(0, 5, 3)));
  EXPECT_EQ(x.images.sizes(), (std::vector<int64_t>{8, 1, 32, 32}));
  EXPECT_GE(x.images.min().item<float>(), 0.f);
  EXPECT_LE(x.images.max().item<float>(), 1.f);
  EXPECT_TRUE(torch::equal(x.masks, (x.masks > 0.5).to(torch::kFloat)));  // binary
}

TEST(SegCapsData, MaskIsTheMainDigitAndClutterIsOutsideIt) {
  auto source = tiny_digits(30, 2);
  capsnet::data::DigitSegmentationOptions clean;
  clean.fragments = 0;
  clean.noise_std = 0;
  // Without clutter and noise the image is the placed digit and the mask is exactly its ink > 0.5.
  auto plain = capsnet::data::DigitSegmentation(source, 3, clean).generate(0, 10);
  EXPECT_TRUE(torch::equal(plain.masks, (plain.images > 0.5).to(torch::kFloat)));
  // The digit is placed whole: ink total equals the source digit's.
  for (int64_t i = 0; i < 10; ++i) EXPECT_GT(plain.masks[i].sum().item<float>(), 0);

  auto cluttered_opt = clean;
  cluttered_opt.fragments = 3;
  auto cluttered = capsnet::data::DigitSegmentation(source, 3, cluttered_opt).generate(0, 10);
  // Same seed: same main digits and placement, so the masks are unchanged by the clutter ...
  EXPECT_TRUE(torch::equal(cluttered.masks, plain.masks));
  EXPECT_TRUE(torch::equal(cluttered.labels, plain.labels));
  // ... every target pixel is still bright, and bright pixels appear outside the target (fragments).
  EXPECT_TRUE((cluttered.images.masked_select(cluttered.masks > 0.5) > 0.5).all().item<bool>());
  const auto outside = ((cluttered.images > 0.5) & (cluttered.masks < 0.5)).sum().item<int64_t>();
  EXPECT_GT(outside, 50);
  // So thresholding the input is not a perfect segmentation.
  EXPECT_LT(capsnet::data::dice_per_image(cluttered.images > 0.5, cluttered.masks).mean().item<double>(), 0.99);
}

TEST(SegCapsData, BadArguments) {
  auto src = tiny_digits(4, 3);
  capsnet::data::DigitSegmentationOptions o;
  o.canvas = 20;
  expect_invalid([&] { capsnet::data::DigitSegmentation(src, 1, o); }, "canvas");
  o = {};
  o.fragment_max = 40;
  expect_invalid([&] { capsnet::data::DigitSegmentation(src, 1, o); }, "fragment_max");
  o = {};
  o.noise_std = -1;
  expect_invalid([&] { capsnet::data::DigitSegmentation(src, 1, o); }, "noise_std");
  expect_invalid([&] { capsnet::data::DigitSegmentation(capsnet::testing::synthetic_set(1, 28, 1), 1); }, "at least 2");
  capsnet::data::DigitSegmentation ok(src, 1);
  expect_invalid([&] { ok.generate(-1, 2); }, "first_n");
  expect_invalid([&] { ok.generate(0, 0); }, "count");
}

TEST(SegCapsData, ForegroundWeightIsTheBackgroundToForegroundRatioOfImagesWithForeground) {
  // Three source digits of different ink: blank (its examples have no foreground), a 4x4 and a 10x10 square.
  capsnet::data::ImageSet source;
  source.images = torch::zeros({3, 28, 28}, torch::kUInt8);
  source.images[1].slice(0, 10, 14).slice(1, 10, 14).fill_(255);
  source.images[2].slice(0, 5, 15).slice(1, 5, 15).fill_(255);
  source.labels = torch::tensor({0, 1, 2}, torch::kLong);
  capsnet::data::DigitSegmentation set(source, 3);
  // By hand over the first 1,203 examples (two chunks and a remainder): images without foreground do not count.
  const auto masks = set.generate(0, 1203).masks.flatten(1) > 0.5;
  double fg = 0, bg = 0;
  int64_t empty = 0;
  for (int64_t i = 0; i < masks.size(0); ++i) {
    const double f = masks[i].sum().item<double>();
    if (f == 0) {
      ++empty;
      continue;
    }
    fg += f;
    bg += static_cast<double>(masks.size(1)) - f;
  }
  ASSERT_GT(empty, 0);
  const double w = capsnet::data::foreground_weight(set, 1203);
  EXPECT_NEAR(w, bg / fg, 1e-12 * w);
  // Both squares and the blank digit were drawn; the weight lies between the two squares' own ratios.
  EXPECT_GT(w, (32.0 * 32 - 100) / 100);
  EXPECT_LT(w, (32.0 * 32 - 16) / 16);
  EXPECT_THROW(capsnet::data::foreground_weight(set, 0), std::invalid_argument);
}

TEST(SegCapsData, DiceValues) {
  auto t = torch::zeros({4, 1, 2, 2});
  auto p = torch::zeros({4, 1, 2, 2});
  t[0].fill_(1);
  p[0].fill_(1);                       // identical: 1
  t[1][0][0][0] = 1;                   // disjoint: 0
  p[1][0][1][1] = 1;
  t[2][0][0].fill_(1);                 // T = 2 pixels, P = 1 of them: 2*1/(1+2)
  p[2][0][0][0] = 1;                   // [3]: both empty: 1
  auto d = capsnet::data::dice_per_image(p, t);
  EXPECT_DOUBLE_EQ(d[0].item<double>(), 1.0);
  EXPECT_DOUBLE_EQ(d[1].item<double>(), 0.0);
  EXPECT_NEAR(d[2].item<double>(), 2.0 / 3.0, 1e-12);
  EXPECT_DOUBLE_EQ(d[3].item<double>(), 1.0);
  expect_invalid([&] { capsnet::data::dice_per_image(p, t.view({4, 4})); }, "same shape");
}

// ---- model --------------------------------------------------------------------------------------

namespace {
capsnet::models::SegCapsConfig tiny_segcaps() { return capsnet::testing::tiny_segcaps_config(); }
}  // namespace

TEST(SegCapsModel, ShapesFusedEqualsCompositeAndTrains) {
  ScopedThreads one(1);
  torch::manual_seed(6);
  capsnet::models::SegCaps model(tiny_segcaps());
  auto images = torch::rand({3, 1, 12, 12});
  auto masks = (images > 0.6).to(torch::kFloat);
  auto out = model->forward(images);
  EXPECT_EQ(out.capsules.sizes(), (std::vector<int64_t>{3, 1, 4, 12, 12}));
  EXPECT_EQ(out.probability.sizes(), (std::vector<int64_t>{3, 1, 12, 12}));
  EXPECT_GE(out.probability.min().item<float>(), 0.f);
  EXPECT_LT(out.probability.max().item<float>(), 1.f);
  model->set_fused_routing(false);
  EXPECT_TRUE(torch::allclose(model->forward(images).probability, out.probability, 1e-5, 1e-6));
  model->set_fused_routing(true);

  // A few Adam steps on one fixed batch must lower the loss (the whole network is differentiable).
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  const double first = model->loss(model->forward(images), masks).item<double>();
  for (int step = 0; step < 15; ++step) {
    auto loss = model->loss(model->forward(images), masks);
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  const double last = model->loss(model->forward(images), masks).item<double>();
  EXPECT_LT(last, 0.9 * first) << first << " -> " << last;
}

TEST(SegCapsModel, ConfigJsonAndBadInput) {
  auto c = tiny_segcaps();
  c.share_across_types = true;
  auto back = capsnet::models::SegCapsConfig::from_json(nlohmann::json::parse(c.to_json().dump()));
  EXPECT_EQ(back.to_json(), c.to_json());
  expect_invalid([] { capsnet::models::SegCapsConfig::from_json({{"typos", 3}}); }, "typos");
  expect_invalid([] { capsnet::models::SegCapsConfig::from_json({{"types", "four"}}); }, "types");
  auto bad = tiny_segcaps();
  bad.image_size = 14;
  expect_invalid([&] { bad.validate(); }, "multiple of 4");
  capsnet::models::SegCaps model(tiny_segcaps());
  expect_invalid([&] { model->forward(torch::rand({2, 1, 16, 16})); }, "[B, 1, 12, 12]");
  auto out = model->forward(torch::rand({1, 1, 12, 12}));
  expect_invalid([&] { model->loss(out, torch::zeros({1, 12, 12})); }, "masks");
}

// ---- loss: class weighting and the masked reconstruction regulariser (SegCaps Sec. 3.1-3.2) ----------

namespace {
capsnet::models::SegCapsConfig tiny_segcaps_with_recon(double recon_weight = 0.5) {
  auto c = tiny_segcaps();
  c.recon_weight = recon_weight;  // the paper's 64 and 128 decoder channels: with a handful, the small
  return c;                        // capsules at initialisation can leave every ReLU dead (seen: 5 and 6)
}
}  // namespace

TEST(SegCapsLoss, WeightedBceMatchesAHandComputedValue) {
  namespace m = capsnet::models;
  auto p = torch::tensor({0.9, 0.2, 0.6, 0.1}, torch::kDouble).view({1, 1, 2, 2});
  auto y = torch::tensor({1.0, 0.0, 1.0, 0.0}, torch::kDouble).view({1, 1, 2, 2});
  // -(w y log p + (1 - y) log(1 - p)), mean over the 4 pixels, w = 3.
  const double expected = -(3 * std::log(0.9) + std::log(0.8) + 3 * std::log(0.6) + std::log(0.9)) / 4;
  EXPECT_NEAR(m::weighted_bce(p, y, 3.0).item<double>(), expected, 1e-12);
  const double plain = -(std::log(0.9) + std::log(0.8) + std::log(0.6) + std::log(0.9)) / 4;
  EXPECT_NEAR(m::weighted_bce(p, y, 1.0).item<double>(), plain, 1e-12);
  // auto: background / foreground pixels of the batch (2 / 2 here; 3 / 1 with one foreground pixel).
  EXPECT_DOUBLE_EQ(m::batch_pos_weight(y), 1.0);
  EXPECT_DOUBLE_EQ(m::batch_pos_weight(torch::tensor({1.0, 0.0, 0.0, 0.0}).view({1, 1, 2, 2})), 3.0);
  EXPECT_DOUBLE_EQ(m::batch_pos_weight(torch::zeros({1, 1, 2, 2})), 1.0);  // no foreground: unweighted
  EXPECT_DOUBLE_EQ(m::batch_pos_weight(torch::ones({1, 1, 2, 2})), 1.0);

  // Through the model: auto_pos_weight uses the batch ratio; recon_weight 0 is exactly the weighted BCE.
  ScopedThreads one(1);
  torch::manual_seed(3);
  auto c = tiny_segcaps();
  c.auto_pos_weight = true;
  m::SegCaps model(c);
  auto images = torch::rand({2, 1, 12, 12});
  auto masks = (images > 0.7).to(torch::kFloat);
  auto out = model->forward(images, masks);
  EXPECT_FALSE(out.reconstruction.defined());  // no decoder
  auto terms = model->loss_terms(out, masks, images);
  EXPECT_DOUBLE_EQ(terms.pos_weight, m::batch_pos_weight(masks));
  EXPECT_GT(terms.pos_weight, 1.5);
  EXPECT_TRUE(torch::equal(terms.total, m::weighted_bce(out.probability, masks, terms.pos_weight)));
  EXPECT_EQ(terms.reconstruction.item<double>(), 0.0);
}

TEST(SegCapsLoss, ReconstructionTargetIsTheMaskedInputAndTheLossAddsItsWeightedMse) {
  namespace m = capsnet::models;
  auto images = torch::rand({2, 1, 12, 12}) + 0.1;  // no zero pixel
  auto masks = (torch::rand({2, 1, 12, 12}) > 0.5).to(torch::kFloat);
  auto target = m::masked_reconstruction_target(images, masks);
  EXPECT_EQ(target.masked_select(masks == 0).abs().max().item<float>(), 0.f);  // zero outside the object
  EXPECT_TRUE(torch::equal(target.masked_select(masks == 1), images.masked_select(masks == 1)));

  ScopedThreads one(1);
  torch::manual_seed(4);
  m::SegCaps model(tiny_segcaps_with_recon(0.5));
  auto out = model->forward(images, masks);
  ASSERT_TRUE(out.reconstruction.defined());
  EXPECT_EQ(out.reconstruction.sizes(), (std::vector<int64_t>{2, 1, 12, 12}));
  EXPECT_TRUE(torch::equal(out.reconstruction, model->decode(out.capsules, masks)));
  auto terms = model->loss_terms(out, masks, images);
  const double mse = (out.reconstruction - images * masks).pow(2).mean().item<double>();
  EXPECT_NEAR(terms.reconstruction.item<double>(), mse, 1e-7);
  EXPECT_NEAR(terms.total.item<double>(), terms.bce.item<double>() + 0.5 * mse, 1e-6);
  EXPECT_DOUBLE_EQ(terms.pos_weight, 1.0);
  // Pixels outside the mask are decoded from a zero capsule: all the same value, whatever the image.
  auto outside = out.reconstruction.masked_select(masks == 0);
  EXPECT_NEAR(outside.max().item<float>(), outside.min().item<float>(), 1e-6);
  // Without masks (inference) nothing is decoded, and the loss says what it needs.
  EXPECT_FALSE(model->forward(images).reconstruction.defined());
  expect_invalid([&] { model->loss(model->forward(images), masks, images); }, "forward(images, masks)");
  expect_invalid([&] { model->decode(out.capsules, masks.squeeze(1)); }, "masks");
  m::SegCaps plain(tiny_segcaps());
  expect_invalid([&] { plain->decode(out.capsules, masks); }, "no decoder");
}

TEST(SegCapsLoss, RegulariserGradientReachesTheDecoderAndTheCapsuleLayers) {
  namespace m = capsnet::models;
  ScopedThreads one(1);
  torch::manual_seed(5);
  m::SegCaps model(tiny_segcaps_with_recon(1.0));
  model->to(torch::kDouble);
  auto images = torch::rand({2, 1, 12, 12}, torch::kDouble);
  auto masks = (images > 0.5).to(torch::kDouble);
  auto params = model->named_parameters();
  // Only the reconstruction term: its gradient must reach the decoder and, through the masked
  // capsules, every capsule layer down to the stem.
  auto recon = [&] { return model->loss_terms(model->forward(images, masks), masks, images).reconstruction; };
  model->zero_grad();
  recon().backward();
  // (The stem reaches the last capsule layer through the skip connection. The deeper path through the
  // U is also connected, but at initialisation its gradient is ~1e-17: squash(s) ~ |s| s for small s.)
  for (const auto* name : {"decoder.0.weight", "decoder.2.weight", "decoder.4.weight", "seg.weight", "stem.weight"}) {
    ASSERT_TRUE(params.contains(name)) << name;
    const auto& g = params[name].grad();
    ASSERT_TRUE(g.defined()) << name;
    EXPECT_GT(g.abs().sum().item<double>(), 1e-8) << name;
  }
  // The values: central differences on a few entries of the decoder's first conv and the last capsule layer.
  capsnet::testing::GradcheckOptions go;
  go.max_elements = 6;
  go.rtol = 1e-3;
  go.atol = 1e-7;
  EXPECT_TRUE(capsnet::testing::gradcheck([&](const std::vector<torch::Tensor>&) { return recon(); },
                                           {params["decoder.0.weight"], params["seg.weight"], params["stem.weight"]},
                                           go));
  // The BCE alone does not touch the decoder.
  model->zero_grad();
  model->loss_terms(model->forward(images, masks), masks, images).bce.backward();
  const auto& g = params["decoder.0.weight"].grad();
  EXPECT_TRUE(!g.defined() || g.abs().sum().item<double>() == 0.0);

  // Capsules outside the mask get no gradient from the regulariser, those inside do.
  auto caps = torch::randn({2, 1, 4, 12, 12}, torch::kDouble).requires_grad_();
  torch::mse_loss(model->decode(caps, masks), m::masked_reconstruction_target(images, masks)).backward();
  auto outside = masks.unsqueeze(2).expand_as(caps) == 0;
  EXPECT_EQ(caps.grad().masked_select(outside).abs().max().item<double>(), 0.0);
  EXPECT_GT(caps.grad().masked_select(~outside).abs().sum().item<double>(), 0.0);
}

TEST(SegCapsLoss, Float64GradcheckDecoder) {
  namespace m = capsnet::models;
  torch::manual_seed(7);
  auto c = tiny_segcaps_with_recon(1.0);
  c.image_size = 8;
  c.recon_hidden1 = 5;  // random capsules below keep these ReLUs alive
  c.recon_hidden2 = 6;
  m::SegCaps model(c);
  model->to(torch::kDouble);
  auto caps = torch::randn({1, 1, 4, 8, 8}, torch::kDouble).requires_grad_();
  auto masks = (torch::rand({1, 1, 8, 8}, torch::kDouble) > 0.4).to(torch::kDouble);
  auto params = model->named_parameters();
  capsnet::testing::GradcheckOptions go;
  go.max_elements = 40;
  EXPECT_TRUE(capsnet::testing::gradcheck(
      [&](const std::vector<torch::Tensor>& x) { return model->decode(x[0], masks); },
      {caps, params["decoder.0.weight"], params["decoder.2.bias"], params["decoder.4.weight"]}, go));
}

TEST(SegCapsLoss, ConfigKeysOldConfigsAndBadValues) {
  namespace m = capsnet::models;
  auto c = tiny_segcaps_with_recon(0.131);
  c.auto_pos_weight = true;
  auto back = m::SegCapsConfig::from_json(nlohmann::json::parse(c.to_json().dump()));
  EXPECT_EQ(back.to_json(), c.to_json());
  EXPECT_EQ(c.to_json().at("recon_weight"), 0.131);
  // A config saved before the options existed: no keys, read as plain BCE without a decoder.
  auto old = tiny_segcaps().to_json();
  for (const auto* key : {"pos_weight", "auto_pos_weight", "recon_weight", "recon_hidden1", "recon_hidden2"})
    old.erase(key);
  auto read = m::SegCapsConfig::from_json(old);
  EXPECT_EQ(read.pos_weight, 1.0);
  EXPECT_FALSE(read.auto_pos_weight);
  EXPECT_EQ(read.recon_weight, 0.0);
  EXPECT_EQ(read.to_json(), tiny_segcaps().to_json());
  m::SegCaps old_model(read);
  for (const auto& p : old_model->named_parameters()) EXPECT_EQ(p.key().rfind("decoder", 0), std::string::npos);
  auto bad = tiny_segcaps();
  bad.pos_weight = 0;
  expect_invalid([&] { bad.validate(); }, "pos_weight");
  bad = tiny_segcaps();
  bad.recon_weight = -1;
  expect_invalid([&] { bad.validate(); }, "recon_weight");
}

// ---- evaluation ---------------------------------------------------------------------------------

// The threshold sweep equals the single-threshold evaluation at every threshold, and the validation choice
// is the argmax of its own sweep, scored on the test images at that threshold.
TEST(SegCapsEval, ThresholdSweepMatchesSingleEvaluationsAndTheChoiceIsTheValidationArgmax) {
  ScopedThreads one(1);
  torch::manual_seed(3);
  auto config = capsnet::testing::tiny_segcaps_config(28);
  capsnet::models::SegCaps model(config);
  capsnet::data::DigitSegmentationOptions d;
  d.canvas = 28;
  auto digits = [](int64_t n, uint64_t seed) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto images = torch::randint(0, 256, {n, 28, 28}, g, torch::kUInt8);
    images.narrow(1, 0, 6).zero_();  // a border, so that the masks do not cover the whole digit square
    return capsnet::data::ImageSet{images, torch::arange(n) % 10};
  };
  const capsnet::data::DigitSegmentation val(digits(6, 1), 11, d), test(digits(6, 2), 12, d);
  const auto grid = capsnet::experiments::threshold_grid();
  ASSERT_EQ(grid.size(), 19u);
  EXPECT_DOUBLE_EQ(grid.front(), 0.05);
  EXPECT_DOUBLE_EQ(grid.back(), 0.95);

  // 5 images in batches of 2 (a short last batch), three thresholds.
  const std::vector<double> ts = {0.2, 0.5, 0.8};
  const auto sweep = capsnet::experiments::dice_by_threshold(model, val, 1, 5, 2, ts);
  ASSERT_EQ(sweep.size(), ts.size());
  for (size_t k = 0; k < ts.size(); ++k)
    EXPECT_NEAR(sweep[k], capsnet::experiments::evaluate_segcaps(model, val, 1, 5, 5, ts[k]).mean_dice, 1e-12) << ts[k];

  const auto c = capsnet::experiments::choose_threshold(model, val, 5, test, 4, 3);
  ASSERT_EQ(c.thresholds, grid);
  const auto whole = capsnet::experiments::dice_by_threshold(model, val, 0, 5, 5, grid);
  ASSERT_EQ(c.val_dice.size(), grid.size());
  for (size_t k = 0; k < grid.size(); ++k) EXPECT_NEAR(c.val_dice[k], whole[k], 1e-12) << grid[k];
  const auto best = std::max_element(whole.begin(), whole.end()) - whole.begin();
  EXPECT_DOUBLE_EQ(c.best_threshold, grid[best]);
  EXPECT_DOUBLE_EQ(c.val_dice_at_best, c.val_dice[best]);
  EXPECT_NEAR(c.test_dice_at_best,
              capsnet::experiments::evaluate_segcaps(model, test, 0, 4, 4, c.best_threshold).mean_dice, 1e-12);
  EXPECT_EQ(c.val_examples, 5);
  EXPECT_EQ(c.test_examples, 4);
  // The sweep is not flat on this model (else the argmax would not be tested).
  EXPECT_GT(*std::max_element(whole.begin(), whole.end()) - *std::min_element(whole.begin(), whole.end()), 0.01);
  EXPECT_TRUE(model->is_training());  // evaluation restores the mode
  expect_invalid([&] { capsnet::experiments::dice_by_threshold(model, val, 0, 0, 2, ts); }, "non-empty");
  expect_invalid([&] { capsnet::experiments::dice_by_threshold(model, val, 0, 2, 2, {}); }, "non-empty");
}

// ---- CLI ----------------------------------------------------------------------------------------

TEST(SegCapsCli, TrainsEvaluatesAndWritesOutputs) {
  const capsnet::testing::CliFolder run;
  const std::string& out = run.out;
  capsnet::testing::write_fake_mnist(run.data, 40, 20);
  auto r = run.run("segcaps",
                   "--steps 3 --batch-size 2 --test-size 4 --canvas 28 --types 2 --stem-channels 4 --figure-rows 2"
                   " --log-every 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("thresholding baseline"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("mean Dice"), std::string::npos) << r.output;
  std::ifstream in(out + "/segcaps.json");
  ASSERT_TRUE(in.good());
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["steps"], 3);
  EXPECT_EQ(j["test_examples"], 4);
  EXPECT_GE(j["test_dice"].get<double>(), 0.0);
  EXPECT_LE(j["test_dice"].get<double>(), 1.0);
  EXPECT_GT(j["baseline"]["test_dice"].get<double>(), 0.0);
  EXPECT_EQ(j["model"]["image_size"], 28);
  // The defaults are the paper's: foreground weighted by the batch's class ratio, reconstruction 0.131.
  EXPECT_EQ(j["model"]["auto_pos_weight"], true);
  EXPECT_EQ(j["model"]["recon_weight"], 0.131);
  EXPECT_EQ(j["pos_weight"], "auto");
  EXPECT_TRUE(std::filesystem::exists(out + "/segcaps.png"));
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoint.pt"));
  // The one loop's format: start, three "train" records (--log-every 1), the checkpoint at the end,
  // the test set's "eval" record with the Dice, end.
  std::ifstream metrics(out + "/metrics.jsonl");
  std::vector<std::string> events;
  for (std::string line; std::getline(metrics, line);) events.push_back(nlohmann::json::parse(line)["event"]);
  EXPECT_EQ(events, (std::vector<std::string>{"start", "train", "train", "train", "checkpoint", "eval", "end"}));
  {
    std::ifstream again(out + "/metrics.jsonl");
    std::string start, train;
    std::getline(again, start);
    std::getline(again, train);
    auto record = nlohmann::json::parse(train);
    EXPECT_GT(record.at("reconstruction_loss").get<double>(), 0.0) << train;
    EXPECT_GT(record.at("pos_weight").get<double>(), 1.0) << train;  // digits cover well under half the canvas
  }

  // A spent --max-minutes budget stops training after the first step and still evaluates.
  r = run.run("segcaps",
              "--steps 50 --max-minutes 1e-6 --batch-size 2 --test-size 2 --canvas 28 --types 2 --stem-channels 4"
              " --figure-rows 0 --overwrite");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("stopping after step 1 of 50"), std::string::npos) << r.output;
  std::ifstream in2(out + "/segcaps.json");
  auto j2 = nlohmann::json::parse(in2);
  EXPECT_EQ(j2["steps"], 1);
  EXPECT_EQ(j2["steps_requested"], 50);
}

// The authors' loss: --pos-weight dataset fixes the class weight, measured once over as many training images
// as there are source digits; --recon-weight 131.072 is their code's reconstruction weight.
TEST(SegCapsCli, DatasetClassWeightIsMeasuredOnceOnTheTrainingImages) {
  const capsnet::testing::CliFolder run;
  capsnet::testing::write_fake_mnist(run.data, 40, 20);
  auto r = run.run("segcaps",
                   "--pos-weight dataset --recon-weight 131.072 --seed 5 --steps 2 --batch-size 2 --test-size 2"
                   " --canvas 28 --types 2 --stem-channels 4 --figure-rows 0 --log-every 1");
  ASSERT_EQ(r.status, 0) << r.output;
  capsnet::data::DigitSegmentationOptions d;
  d.canvas = 28;
  capsnet::data::DigitSegmentation train_set(capsnet::data::load_mnist(run.data, capsnet::data::Split::kTrain), 5, d);
  const double want = capsnet::data::foreground_weight(train_set, 40);
  EXPECT_NE(r.output.find(fmt::format("over 40 training images = {:.4f}", want)), std::string::npos) << r.output;
  std::ifstream in(run.out + "/segcaps.json");
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["pos_weight"], "dataset");
  EXPECT_EQ(j["model"]["auto_pos_weight"], false);
  EXPECT_DOUBLE_EQ(j["model"]["pos_weight"].get<double>(), want);
  EXPECT_EQ(j["model"]["recon_weight"], 131.072);
  std::ifstream metrics(run.out + "/metrics.jsonl");
  int train_records = 0;
  for (std::string line; std::getline(metrics, line);) {
    auto record = nlohmann::json::parse(line);
    if (record["event"] != "train") continue;
    ++train_records;
    EXPECT_NEAR(record.at("pos_weight").get<double>(), want, 1e-12 * want) << line;  // the same every step
  }
  EXPECT_EQ(train_records, 2);
}

// --val N holds out the last N training digits: N validation images choose the threshold, the JSON records
// the sweep and the test Dice at the chosen threshold, and a resume with another split is refused.
TEST(SegCapsCli, ValidationSplitChoosesTheThreshold) {
  const capsnet::testing::CliFolder run;
  capsnet::testing::write_fake_mnist(run.data, 40, 20);
  const std::string base =
      "--batch-size 2 --test-size 4 --canvas 28 --types 2 --stem-channels 4 --figure-rows 0 --seed 4";
  const std::string common = "--steps 2 " + base;
  auto r = run.run("segcaps", common + " --val 6");
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(run.out + "/segcaps.json");
  auto j = nlohmann::json::parse(in);
  const auto& v = j.at("validation");
  EXPECT_EQ(v["held_out_digits"], 6);
  EXPECT_EQ(v["examples"], 6);
  EXPECT_EQ(v["seed"], 1002);  // --test-seed 1001 + 1
  ASSERT_EQ(v["thresholds"].size(), 19u);
  ASSERT_EQ(v["dice"].size(), 19u);
  const auto dice = v["dice"].get<std::vector<double>>();
  const auto best = std::max_element(dice.begin(), dice.end()) - dice.begin();
  EXPECT_DOUBLE_EQ(v["best_threshold"].get<double>(), v["thresholds"][best].get<double>());
  EXPECT_DOUBLE_EQ(v["val_dice_at_best"].get<double>(), dice[best]);
  EXPECT_GE(v["test_dice_at_best"].get<double>(), 0.0);
  EXPECT_LE(v["test_dice_at_best"].get<double>(), 1.0);
  EXPECT_NE(
      r.output.find(fmt::format("threshold chosen on 6 validation images: {:.2f}", v["best_threshold"].get<double>())),
      std::string::npos)
      << r.output;
  // Without --val there is no validation block.
  auto plain = run.run_to(run.out + "/plain", "segcaps", common);
  ASSERT_EQ(plain.status, 0) << plain.output;
  std::ifstream in2(run.out + "/plain/segcaps.json");
  EXPECT_FALSE(nlohmann::json::parse(in2).contains("validation"));
  // The split is part of the run: resuming with another one is refused.
  EXPECT_TRUE(FailsSaying(run.run("segcaps", base + " --steps 3 --resume " + run.out + "/checkpoint.pt"),
                          "option val is 6 in the checkpoint but 0 now"));
  EXPECT_TRUE(FailsSaying(run.run("segcaps", common + " --val 40 --overwrite"), "hold-out of 40"));
}

TEST(SegCapsCli, BadOptions) {
  capsnet::testing::TempDir dir;
  const auto segcaps = [&](const std::string& args) {
    return capsnet::testing::run_cli("segcaps " + args + " --out " + (dir / "o"));
  };
  EXPECT_TRUE(FailsSaying(segcaps("--canvas 30 --data " + (dir / "none")), "multiple of 4"));
  EXPECT_TRUE(FailsSaying(segcaps("--steps 0"), "--steps"));
  EXPECT_TRUE(FailsSaying(segcaps("--fragments -2"), "--fragments"));
  for (const std::string bad : {"foo", "0", "-1", "nan", "2e6", "1x"})
    EXPECT_TRUE(FailsSaying(segcaps("--pos-weight " + bad), "--pos-weight must be 'auto', 'dataset' or a number"))
        << bad;
  EXPECT_TRUE(FailsSaying(segcaps("--recon-weight -1"), "--recon-weight"));
  EXPECT_TRUE(FailsSaying(segcaps("--val -3"), "--val"));
  EXPECT_TRUE(FailsSaying(segcaps("--val 1"), "--val must be 0 or at least 2"));
  EXPECT_TRUE(FailsSaying(segcaps("--steps 1 --data " + (dir / "missing")), "missing"));
}
