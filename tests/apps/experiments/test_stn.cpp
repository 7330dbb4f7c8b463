// Spatial transformer (nn/spatial_transformer), distorted MNIST (data/distorted), the --stn option of
// CapsNet / BaselineCnn, and the `capsnet stn` command end to end.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "capsnet/data/distorted.h"
#include "capsnet/data/mnist.h"
#include "capsnet/data/transforms.h"
#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/nn/spatial_transformer.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/viz/png.h"
#include "gradcheck.h"
#include "cli_helpers.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::GradcheckOptions;
using testing::ScopedThreads;

/// Expects `fn` to throw std::invalid_argument whose message contains `needle`.
template <class Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one naming '" << needle << "'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

/// A theta near the identity with random off-identity parts, away from integer sample positions.
torch::Tensor random_theta(int64_t batch, double spread) {
  return nn::identity_theta(batch, torch::kDouble) + spread * torch::randn({batch, 2, 3}, torch::kDouble);
}

TEST(SpatialTransformerTest, SamplerMatchesReferenceInValuesAndGradients) {
  ScopedThreads one(1);
  torch::manual_seed(3);
  // Different input and output sizes; theta large enough that some samples fall outside (zero padding).
  auto input = torch::randn({2, 2, 5, 6}, torch::kDouble).requires_grad_();
  auto theta = random_theta(2, 0.4).requires_grad_();
  const auto R = torch::randn({2, 2, 4, 7}, torch::kDouble);
  auto fast = nn::affine_sample(input, theta, 4, 7);
  auto ref = nn::detail::reference_affine_sample(input, theta, 4, 7);
  ASSERT_EQ(fast.sizes(), ref.sizes());
  EXPECT_TRUE(torch::allclose(fast, ref, 1e-10, 1e-12)) << (fast - ref).abs().max();
  EXPECT_GT(ref.eq(0).sum().item<int64_t>(), 0) << "expected some zero-padded samples";
  auto g_fast = torch::autograd::grad({(fast * R).sum()}, {input, theta});
  auto g_ref = torch::autograd::grad({(ref * R).sum()}, {input, theta});
  EXPECT_TRUE(torch::allclose(g_fast[0], g_ref[0], 1e-10, 1e-12)) << "d/d input";
  EXPECT_TRUE(torch::allclose(g_fast[1], g_ref[1], 1e-9, 1e-11)) << "d/d theta: " << g_fast[1] << g_ref[1];
  EXPECT_GT(g_ref[1].abs().sum().item<double>(), 0);
}

TEST(SpatialTransformerTest, SamplerFloat64Gradcheck) {
  ScopedThreads one(1);
  torch::manual_seed(4);
  auto input = torch::randn({2, 3, 4, 5}, torch::kDouble).requires_grad_();
  auto theta = random_theta(2, 0.3).requires_grad_();
  auto fn = [](const std::vector<torch::Tensor>& in) { return nn::affine_sample(in[0], in[1], 3, 6); };
  EXPECT_TRUE(testing::gradcheck(fn, {input, theta}));
  auto ref = [](const std::vector<torch::Tensor>& in) {
    return nn::detail::reference_affine_sample(in[0], in[1], 3, 6);
  };
  EXPECT_TRUE(testing::gradcheck(ref, {input, theta}));
}

TEST(SpatialTransformerTest, WholeModuleFloat64GradcheckOverAllParameters) {
  ScopedThreads one(1);
  torch::manual_seed(5);
  nn::SpatialTransformer stn(
      nn::SpatialTransformerOptions(2, 8, 8).loc_channels1(3).loc_channels2(4).loc_hidden(5).loc_kernel(3));
  stn->to(torch::kDouble);
  {
    // At init loc_fc2 is zero and every earlier gradient vanishes; move away so all are checked.
    // The bias moves too: at the identity the sampling points sit exactly on pixel centres, where
    // bilinear interpolation has a kink (one-sided analytic vs averaged numeric derivative), and an
    // image whose hidden ReLUs are all off gets exactly the bias as its theta.
    torch::NoGradGuard no_grad;
    stn->loc_fc2->weight.normal_(0, 0.05);
    stn->loc_fc2->bias.add_(torch::randn({6}, torch::kDouble) * 0.05);
  }
  const auto images = torch::randn({2, 2, 8, 8}, torch::kDouble);
  std::vector<torch::Tensor> params;
  for (auto& p : stn->parameters()) params.push_back(p);
  ASSERT_EQ(params.size(), 8u);
  GradcheckOptions o;
  o.max_elements = 12;
  auto fn = [&](const std::vector<torch::Tensor>&) { return stn(images); };
  EXPECT_TRUE(testing::gradcheck(fn, params, o));
  // And through the image (the localization net and the sampler both see it).
  auto x = images.clone().requires_grad_();
  EXPECT_TRUE(testing::gradcheck([&](const std::vector<torch::Tensor>& in) { return stn(in[0]); }, {x}, o));
}

TEST(SpatialTransformerTest, IsTheIdentityAtInit) {
  ScopedThreads one(1);
  torch::manual_seed(6);
  nn::SpatialTransformer stn(nn::SpatialTransformerOptions(3, 10, 12));
  const auto images = torch::rand({4, 3, 10, 12});
  auto out = stn->forward_with_theta(images);
  EXPECT_TRUE(torch::equal(out.theta, nn::identity_theta(4))) << out.theta;
  EXPECT_EQ(out.output.sizes(), images.sizes());
  EXPECT_TRUE(torch::allclose(out.output, images, 0, 1e-5)) << (out.output - images).abs().max();
  EXPECT_EQ(nn::num_parameters(stn->options), models::count_parameters(*stn));
}

TEST(SpatialTransformerTest, WholePixelTranslationMovesTheImageByThatManyPixels) {
  ScopedThreads one(1);
  torch::manual_seed(7);
  const int64_t H = 7, W = 9, kx = 2, ky = -3;
  auto input = torch::rand({1, 2, H, W}, torch::kDouble);
  // align_corners = false: a shift of t in normalised units is t * W / 2 pixels.
  auto theta = nn::identity_theta(1, torch::kDouble);
  theta[0][0][2] = 2.0 * kx / W;
  theta[0][1][2] = 2.0 * ky / H;
  for (const auto& out : {nn::affine_sample(input, theta, H, W), nn::detail::reference_affine_sample(input, theta, H, W)}) {
    for (int64_t i = 0; i < H; ++i)
      for (int64_t j = 0; j < W; ++j) {
        const int64_t si = i + ky, sj = j + kx;
        const bool inside = si >= 0 && si < H && sj >= 0 && sj < W;
        for (int64_t c = 0; c < 2; ++c) {
          const double want = inside ? input[0][c][si][sj].item<double>() : 0.0;
          ASSERT_NEAR(out[0][c][i][j].item<double>(), want, 1e-9) << "pixel " << i << "," << j;
        }
      }
  }
}

TEST(SpatialTransformerTest, BadInputThrowsNamingTheArgument) {
  auto img = torch::rand({2, 1, 6, 6});
  auto theta = nn::identity_theta(2);
  expect_invalid([&] { nn::affine_sample(img[0], theta, 6, 6); }, "input");
  expect_invalid([&] { nn::affine_sample(img, torch::zeros({2, 3, 3}), 6, 6); }, "theta");
  expect_invalid([&] { nn::affine_sample(img, nn::identity_theta(3), 6, 6); }, "batch");
  expect_invalid([&] { nn::affine_sample(img, theta.to(torch::kDouble), 6, 6); }, "dtype");
  expect_invalid([&] { nn::affine_sample(img, theta, 0, 6); }, "out_h");
  expect_invalid([&] { nn::detail::reference_affine_sample(img, torch::zeros({2, 2}), 6, 6); }, "theta");
  nn::SpatialTransformer stn(nn::SpatialTransformerOptions(1, 6, 6));
  expect_invalid([&] { stn(torch::rand({6, 6})); }, "images must be [B, C, H, W]");
  expect_invalid([&] { stn(torch::rand({2, 3, 6, 6})); }, "channels");
  expect_invalid([&] { stn(torch::rand({2, 1, 6, 8})); }, "6 x 8");
  expect_invalid([&] { nn::SpatialTransformer(nn::SpatialTransformerOptions(1, 3, 6)); }, "height");
  expect_invalid([&] { nn::SpatialTransformer(nn::SpatialTransformerOptions(0, 6, 6)); }, "channels");
  expect_invalid([&] { nn::SpatialTransformer(nn::SpatialTransformerOptions(1, 6, 6).loc_kernel(4)); }, "loc_kernel");
}

/// Solid rectangles of varying size (classes 0..9), a clean bounding box for the mass test.
data::ImageSet block_digits(int64_t n) {
  data::ImageSet s;
  s.labels = torch::arange(n, torch::kLong) % 10;
  s.images = torch::zeros({n, 28, 28}, torch::kUInt8);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = i % 10;
    s.images[i].narrow(0, 6, 12 + k).narrow(1, 10, 5 + k / 2).fill_(200);
  }
  return s;
}

TEST(DistortedMnistTest, BatchesAreDeterministicPerSeedAndIndex) {
  ScopedThreads one(1);
  const auto src = block_digits(30);
  auto a = data::distorted_batch(src, 7, 0, 12);
  ASSERT_EQ(a.images.sizes(), (std::vector<int64_t>{12, 1, 42, 42}));
  EXPECT_GE(a.images.min().item<float>(), 0.0f);
  EXPECT_LE(a.images.max().item<float>(), 1.0f);
  EXPECT_TRUE(torch::equal(a.labels, src.labels.index_select(0, a.source_index)));
  auto again = data::distorted_batch(src, 7, 0, 12);
  EXPECT_TRUE(torch::equal(a.images, again.images));
  auto middle = data::distorted_batch(src, 7, 5, 3);  // example n depends on (seed, n) only
  EXPECT_TRUE(torch::equal(middle.images, a.images.narrow(0, 5, 3)));
  EXPECT_TRUE(torch::equal(middle.source_index, a.source_index.narrow(0, 5, 3)));
  auto other = data::distorted_batch(src, 8, 0, 12);
  EXPECT_FALSE(torch::equal(a.images, other.images));

  auto set = data::distorted_set(src, 3);
  ASSERT_EQ(set.images.sizes(), (std::vector<int64_t>{30, 42, 42}));
  EXPECT_EQ(set.images.scalar_type(), torch::kUInt8);
  EXPECT_TRUE(torch::equal(set.labels, src.labels));
  auto prefix = data::distorted_set(data::take(src, 4), 3);
  EXPECT_TRUE(torch::equal(prefix.images, set.images.narrow(0, 0, 4)));
}

TEST(DistortedMnistTest, ParametersCoverTheirRangesAndInkMassScalesWithArea) {
  ScopedThreads one(1);
  const auto src = block_digits(10);
  const int64_t n = 200;
  auto b = data::distorted_batch(src, 11, 0, n);
  double min_rot = 1e9, max_rot = -1e9, min_s = 1e9, max_s = -1e9;
  const auto src_mass = src.images.to(torch::kDouble).sum({1, 2}) / 255.0;  // [10]
  const auto out_mass = b.images.to(torch::kDouble).sum({1, 2, 3});         // [n]
  for (int64_t i = 0; i < n; ++i) {
    const auto& p = b.params[static_cast<size_t>(i)];
    ASSERT_GE(p.rotation_deg, -45.0);
    ASSERT_LE(p.rotation_deg, 45.0);
    ASSERT_GE(p.scale_x, 0.7);
    ASSERT_LE(p.scale_x, 1.2);
    ASSERT_EQ(p.scale_x, p.scale_y);
    ASSERT_EQ(p.shear, 0.0);
    min_rot = std::min(min_rot, p.rotation_deg), max_rot = std::max(max_rot, p.rotation_deg);
    min_s = std::min(min_s, p.scale_x), max_s = std::max(max_s, p.scale_x);
    // Bilinear resampling keeps the ink of a solid block up to edge effects: mass ~ s^2 * source mass,
    // and nothing is cropped (the translation keeps the digit inside the canvas).
    const double want = p.scale_x * p.scale_x * src_mass[b.source_index[i].item<int64_t>()].item<double>();
    ASSERT_NEAR(out_mass[i].item<double>() / want, 1.0, 0.08) << "example " << i;
    // The outermost ring of the canvas stays black.
    const auto img = b.images[i][0];
    ASSERT_EQ(img[0].sum().item<float>() + img[41].sum().item<float>() + img.select(1, 0).sum().item<float>() +
                  img.select(1, 41).sum().item<float>(),
              0.0f)
        << "example " << i;
  }
  EXPECT_LT(min_rot, -38);
  EXPECT_GT(max_rot, 38);
  EXPECT_LT(min_s, 0.75);
  EXPECT_GT(max_s, 1.15);
  // Translations spread over the canvas: centres of mass vary by many pixels.
  const auto xs = torch::arange(42, torch::kDouble);
  const auto cx = (b.images.to(torch::kDouble).sum(2).squeeze(1) * xs).sum(1) / out_mass;  // [n]
  EXPECT_GT((cx.max() - cx.min()).item<double>(), 15.0);
}

TEST(DistortedMnistTest, BadArgumentsThrowClearly) {
  const auto src = block_digits(4);
  data::DistortionRanges r;
  r.min_scale = 0;
  expect_invalid([&] { data::distorted_batch(src, 1, 0, 2, 42, r); }, "min_scale");
  r = {};
  r.max_rotation_deg = 200;
  expect_invalid([&] { data::distorted_set(src, 1, 42, r); }, "max_rotation_deg");
  expect_invalid([&] { data::distorted_batch(src, 1, 0, 0); }, "count");
  expect_invalid([&] { data::distorted_batch(src, 1, -1, 2); }, "first");
  data::ImageSet bad{src.images.to(torch::kFloat), src.labels};
  expect_invalid([&] { data::distorted_set(bad, 1); }, "source images");
  expect_invalid([&] { data::distorted_source_index(1, 0, 0); }, "num_source");
}

TEST(StnModelTest, CapsNetAndCnnWithStnStartAsTheModelWithoutIt) {
  ScopedThreads one(1);
  auto c = testing::tiny_config();
  c.stn = true;
  const auto images = torch::rand({3, 1, 12, 12});
  torch::manual_seed(9);
  models::CapsNet with(c);
  c.stn = false;
  torch::manual_seed(9);
  models::CapsNet without(c);
  ASSERT_TRUE(with->stn);
  ASSERT_FALSE(without->stn);
  // The STN is registered last, so the rest of the model draws the same initial weights.
  EXPECT_TRUE(torch::allclose(with(images).lengths, without(images).lengths, 1e-4, 1e-5));
  EXPECT_EQ(models::count_parameters(*with) - models::count_parameters(*without),
            nn::num_parameters(nn::SpatialTransformerOptions(1, 12, 12)));
  // The gradient reaches the localization net's output layer (the only one alive at init).
  const auto labels = torch::tensor({1, 2, 3}, torch::kLong);
  auto out = with(images, labels);
  with->loss(out, images, labels).total.backward();
  EXPECT_GT(with->stn->loc_fc2->weight.grad().abs().sum().item<float>(), 0.0f);

  models::BaselineCnnConfig cc;
  cc.image_size = 12, cc.conv1_channels = 4, cc.conv2_channels = 4, cc.conv3_channels = 4, cc.fc1_units = 8,
  cc.fc2_units = 8;
  cc.stn = true;
  torch::manual_seed(10);
  models::BaselineCnn cnn_with(cc);
  EXPECT_EQ(cc.num_parameters(), models::count_parameters(*cnn_with));
  cc.stn = false;
  torch::manual_seed(10);
  models::BaselineCnn cnn_without(cc);
  cnn_with->eval(), cnn_without->eval();
  EXPECT_TRUE(torch::allclose(cnn_with(images), cnn_without(images), 1e-4, 1e-5));
}

// stn_size: the transformer resamples the input to another side and the network behind it is built for
// that side; at init (identity theta) the model equals the same network fed the resampled input, the
// decoder still reconstructs the full-size input, and bad sizes fail naming the field.
TEST(StnModelTest, AResamplingTransformerFeedsTheNetworkItsOutputSize) {
  ScopedThreads one(1);
  const auto images = torch::rand({3, 1, 16, 16});
  const auto resampled = nn::affine_sample(images, nn::identity_theta(3), 12, 12);  // [3, 1, 12, 12]
  auto c = testing::tiny_config();
  c.image_size = 16, c.stn = true, c.stn_size = 12;
  EXPECT_EQ(c.network_size(), 12);
  EXPECT_EQ(c.conv1_grid(), 10);
  torch::manual_seed(11);
  models::CapsNet with(c);
  auto plain_config = testing::tiny_config();  // 12 x 12, no transformer
  torch::manual_seed(11);
  models::CapsNet plain(plain_config);
  const auto labels = torch::tensor({1, 2, 3}, torch::kLong);
  const auto out = with(images, labels);
  EXPECT_TRUE(torch::allclose(out.lengths, plain(resampled).lengths, 1e-4, 1e-5));
  EXPECT_EQ(out.reconstruction.size(1), 16 * 16);  // the untransformed input
  EXPECT_EQ(with->stn->forward(images).sizes(), (std::vector<int64_t>{3, 1, 12, 12}));
  EXPECT_EQ(models::CapsNetConfig::from_json(c.to_json()).stn_size, 12);
  auto j = c.to_json();
  j.erase("stn_size");  // a config written before the field existed
  EXPECT_EQ(models::CapsNetConfig::from_json(j).stn_size, 0);
  EXPECT_EQ(models::CapsNetConfig::from_json(j).network_size(), 16);
  auto bad = c;
  bad.stn = false;
  expect_invalid([&] { bad.validate(); }, "stn_size 12 needs stn");
  bad = c, bad.stn_size = 4;
  expect_invalid([&] { bad.validate(); }, "stn_size 4 is too small");
  bad = c, bad.stn_size = -1;
  expect_invalid([&] { bad.validate(); }, "stn_size must be >= 0");

  models::BaselineCnnConfig cc;
  cc.image_size = 16, cc.conv1_channels = 4, cc.conv2_channels = 4, cc.conv3_channels = 4, cc.fc1_units = 8,
  cc.fc2_units = 8;
  cc.stn = true, cc.stn_size = 12;
  EXPECT_EQ(cc.feature_size(), 3);
  torch::manual_seed(12);
  models::BaselineCnn cnn(cc);
  EXPECT_EQ(cc.num_parameters(), models::count_parameters(*cnn));
  auto pc = cc;
  pc.image_size = 12, pc.stn = false, pc.stn_size = 0;
  torch::manual_seed(12);
  models::BaselineCnn cnn_plain(pc);
  cnn->eval(), cnn_plain->eval();
  EXPECT_TRUE(torch::allclose(cnn(images), cnn_plain(resampled), 1e-4, 1e-5));
  EXPECT_EQ(models::BaselineCnnConfig::from_json(cc.to_json()).stn_size, 12);
  auto badc = cc;
  badc.stn_size = 3;
  expect_invalid([&] { badc.validate(); }, "stn_size 3 is too small");
  badc = cc, badc.stn = false;
  expect_invalid([&] { badc.validate(); }, "stn_size 12 needs stn");
}

TEST(StnModelTest, ConfigJsonRoundTripAndOldConfigsWithoutTheField) {
  auto c = testing::tiny_config();
  c.stn = true;
  EXPECT_TRUE(models::CapsNetConfig::from_json(c.to_json()).stn);
  auto j = c.to_json();
  j.erase("stn");  // a checkpoint written before the field existed
  EXPECT_FALSE(models::CapsNetConfig::from_json(j).stn);
  expect_invalid([&] { models::CapsNetConfig::from_json(nlohmann::json::parse(R"({"stn": 1})")); }, "stn");
  models::BaselineCnnConfig cc;
  cc.stn = true;
  EXPECT_TRUE(models::BaselineCnnConfig::from_json(cc.to_json()).stn);
  auto jc = cc.to_json();
  jc.erase("stn");
  EXPECT_FALSE(models::BaselineCnnConfig::from_json(jc).stn);
}

TEST(StnModelTest, CheckpointRestoresTheTransformer) {
  ScopedThreads one(1);
  testing::TempDir dir;
  auto c = testing::tiny_config();
  c.stn = true;
  torch::manual_seed(12);
  models::CapsNet model(c);
  {
    torch::NoGradGuard no_grad;
    model->stn->loc_fc2->weight.normal_(0, 0.1);  // not the identity any more
  }
  model->eval();
  train::CheckpointMeta meta;
  meta.model_config = c.to_json();
  save_checkpoint(dir / "ckpt.pt", model, nullptr, meta);
  auto loaded = train::load_model(dir / "ckpt.pt");
  loaded->eval();
  ASSERT_TRUE(loaded->stn);
  const auto images = torch::rand({2, 1, 12, 12});
  EXPECT_TRUE(torch::allclose(loaded->stn(images), model->stn(images)));
  EXPECT_TRUE(torch::allclose(loaded(images).lengths, model(images).lengths));
}

// A checkpoint written before CapsNetConfig had "stn" stores no such key; it must still load (as stn
// off), both through load_model and into a model built by hand (found by loading a 1-epoch run).
TEST(StnModelTest, CheckpointWithoutTheStnKeyStillLoads) {
  ScopedThreads one(1);
  testing::TempDir dir;
  const auto c = testing::tiny_config();
  torch::manual_seed(13);
  models::CapsNet model(c);
  train::CheckpointMeta meta;
  meta.model_config = c.to_json();
  ASSERT_EQ(meta.model_config.erase("stn"), 1u);
  save_checkpoint(dir / "old.pt", model, nullptr, meta);
  auto loaded = train::load_model(dir / "old.pt");
  EXPECT_FALSE(loaded->config.stn);
  models::CapsNet again(c);
  EXPECT_NO_THROW(train::load_checkpoint(dir / "old.pt", again, nullptr));
  const auto images = torch::rand({2, 1, 12, 12});
  loaded->eval();
  again->eval();
  model->eval();
  EXPECT_TRUE(torch::allclose(loaded(images).lengths, model(images).lengths));
  EXPECT_TRUE(torch::allclose(again(images).lengths, model(images).lengths));
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(StnCliTest, RunsTheGridAndWritesJsonTableMetricsAndFigure) {
  const testing::CliFolder run;
  const std::string& out = run.out;
  testing::write_fake_mnist(run.data, 40, 10);
  auto r = run.run("stn", "--steps 2 --batch-size 4 --test-limit 10 --small --log-every 1 --figure-examples 7");
  ASSERT_EQ(r.status, 0) << r.output;
  auto report = nlohmann::json::parse(read_all(out + "/stn.json"));
  ASSERT_EQ(report["results"].size(), 4u);
  std::vector<std::string> names;
  for (const auto& row : report["results"]) {
    names.push_back(row["name"]);
    EXPECT_EQ(row["steps"], 2);
    EXPECT_EQ(row["training_images_seen"], 8);
    EXPECT_GE(row["test_accuracy"].get<double>(), 0.0);
    EXPECT_LE(row["test_accuracy"].get<double>(), 1.0);
    EXPECT_EQ(row.contains("theta"), row["stn"].get<bool>());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"capsnet", "capsnet+stn", "cnn", "cnn+stn"}));
  const auto md = read_all(out + "/stn.md");
  EXPECT_NE(md.find("| capsnet | yes |"), std::string::npos) << md;
  EXPECT_NE(md.find("| cnn | no |"), std::string::npos) << md;
  // 7 examples -> 2 rows of 6 pairs per STN run, 2 runs + 1 separator row: 5 rows x 12 tiles of 42 + 2.
  const auto png = viz::read_png_gray(out + "/stn_transforms.png");
  EXPECT_EQ(png.size(0), 5 * 44 + 2);
  EXPECT_EQ(png.size(1), 12 * 44 + 2);
  const auto metrics = read_all(out + "/metrics.jsonl");
  size_t evals = 0;
  for (size_t p = metrics.find("\"event\":\"eval\""); p != std::string::npos; p = metrics.find("\"event\":\"eval\"", p + 1))
    ++evals;
  EXPECT_EQ(evals, 4u) << metrics;

  // --stn-size: the STN cell's network sees a 20 x 20 resampling, the figure still tiles 42 x 42 pairs.
  const std::string out3 = run.dir / "out3";
  r = run.run_to(out3, "stn", "--model cnn --stn on --stn-size 20 --steps 1 --batch-size 4 --test-limit 3 --small");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto report3 = nlohmann::json::parse(read_all(out3 + "/stn.json"));
  EXPECT_EQ(report3["options"]["stn_size"], 20);
  EXPECT_EQ(viz::read_png_gray(out3 + "/stn_transforms.png").size(1), 12 * 44 + 2);

  // One cell of the grid only; no STN run means no figure.
  const std::string out2 = run.dir / "out2";
  r = run.run_to(out2, "stn", "--model cnn --stn off --steps 1 --batch-size 4 --test-limit 5 --small");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(read_all(out2 + "/stn.json"))["results"].size(), 1u);
  EXPECT_FALSE(std::filesystem::exists(out2 + "/stn_transforms.png"));
}

TEST(StnCliTest, BadOptionsFailNamingTheOption) {
  const testing::CliFolder run;
  testing::write_fake_mnist(run.data, 8, 4);
  for (const auto& [args, needle] :
       std::vector<std::pair<std::string, std::string>>{{"--model resnet", "--model"},
                                                        {"--stn maybe", "--stn"},
                                                        {"--steps 0", "--steps"},
                                                        {"--batch-size -1", "--batch-size"},
                                                        {"--val 8", "--val 8 must leave training images"},
                                                        {"--target-accuracy 0.9", "--target-accuracy needs --epochs"},
                                                        {"--stn-size -1", "--stn-size"},
                                                        {"--stn-size 2 --batch-size 4", "stn_size 2 is too small"}})
    EXPECT_TRUE(testing::FailsSaying(run.run("stn", args), needle)) << args;
  const std::string missing = run.dir / "missing";
  EXPECT_TRUE(
      testing::FailsSaying(testing::run_cli("stn --data " + missing + " --out " + run.out + " --steps 1"), missing));
}

/// The "eval" records of one model's run, in order: (split, step, accuracy).
std::vector<std::tuple<std::string, int64_t, double>> evals_of(const std::string& run_dir) {
  std::vector<std::tuple<std::string, int64_t, double>> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "eval") out.emplace_back(j["split"], j["step"], j["accuracy"]);
  }
  return out;
}

// --val: the validation split is scored after every epoch, the model scored on the test set is the
// best-validation checkpoint (its accuracy recomputed here from best.pt), and a run continued with
// --resume ends exactly where one uninterrupted run does.
TEST(StnCliTest, AValidationSplitPicksTheScoredCheckpointAndRunsResumeExactly) {
  const testing::CliFolder run;
  testing::write_fake_mnist(run.data, 40, 10);
  const auto train = [&](const std::string& out, int epochs, const std::string& extra) {
    return run.run_to(out, "stn",
                      "--model cnn --stn on --small --val 8 --epochs " + std::to_string(epochs) +
                          " --batch-size 8 --lr 3e-3 --test-limit 10 --precision fp32" + extra);
  };
  const std::string whole = run.dir / "whole", parts = run.dir / "parts";
  auto r = train(whole, 3, "");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto evals = evals_of(whole + "/cnn+stn");  // 32 training images: 4 steps per epoch
  ASSERT_EQ(evals.size(), 3u);
  double best = -1;
  int64_t best_step = 0;
  for (size_t k = 0; k < evals.size(); ++k) {
    const auto& [split, step, acc] = evals[k];
    EXPECT_EQ(split, "val");
    EXPECT_EQ(step, 4 * static_cast<int64_t>(k + 1));
    if (acc > best) best = acc, best_step = step;
  }
  const auto row = nlohmann::json::parse(read_all(whole + "/stn.json"))["results"][0];
  EXPECT_EQ(row["scored_checkpoint"].get<std::string>().rfind("best.pt (step " + std::to_string(best_step) + ",", 0),
            0u)
      << row["scored_checkpoint"];

  // The test accuracy is best.pt's: load it into the same model and score the same distorted test set.
  models::BaselineCnnConfig c;
  c.image_size = data::kDistortedCanvas;
  c.conv1_channels = 64, c.conv2_channels = 64, c.conv3_channels = 32;
  c.stn = true;
  models::BaselineCnn model(c);
  train::load_checkpoint(whole + "/cnn+stn/best.pt", *model, nullptr, [](const nlohmann::json&) { return true; });
  model->eval();
  const auto test = data::distorted_set(data::take(data::load_mnist(run.data, data::Split::kTest), 10), 2015);
  torch::NoGradGuard no_grad;
  const double acc = model(data::to_float(test.images)).argmax(1).eq(test.labels).to(torch::kDouble).mean().item<double>();
  EXPECT_DOUBLE_EQ(row["test_accuracy"].get<double>(), acc);

  // Two epochs, then a third with --resume: the same validation curve and the same scored model.
  r = train(parts, 2, "");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train(parts, 3, " --resume");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(evals_of(parts + "/cnn+stn"), evals);
  const auto resumed = nlohmann::json::parse(read_all(parts + "/stn.json"))["results"][0];
  EXPECT_EQ(resumed["test_accuracy"], row["test_accuracy"]);
  EXPECT_EQ(resumed["scored_checkpoint"], row["scored_checkpoint"]);
  EXPECT_EQ(resumed["steps"], 12);
}

TEST(StnCliTest, TrainAcceptsStnAndStoresItInTheCheckpoint) {
  const testing::CliFolder run;
  testing::write_fake_mnist(run.data, 8, 4);
  auto r = run.run("train", "--stn --steps 1 --batch-size 2 --no-eval");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto meta = train::read_checkpoint_meta(run.out + "/checkpoint.pt");
  EXPECT_EQ(meta.model_config.value("stn", false), true) << meta.model_config;
}

}  // namespace
}  // namespace capsnet
