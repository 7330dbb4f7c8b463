// CapsPix2pix (docs/capspix2pix.md): the label-map data, the generators and discriminator, the GAN
// step on the one loop, the image scores and the figures.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "capsnet/data/label_maps.h"
#include "capsnet/models/capspix2pix.h"
#include "apps/experiments/capspix2pix.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/viz/png.h"
#include "gradcheck.h"
#include "cli_helpers.h"
#include "loop_options.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace {

using capsnet::data::LabelMapOptions;
using capsnet::data::LabelMaps;
using capsnet::models::Pix2pix;
using capsnet::models::Pix2pixConfig;

const std::string kCli = CAPSNET_CLI;

/// Source images with objects: a filled rectangle of random size and place per image, textured ink.
capsnet::data::ImageSet blob_set(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  capsnet::data::ImageSet set;
  set.labels = torch::arange(n, torch::kLong) % 10;
  set.images = torch::zeros({n, 28, 28}, torch::kUInt8);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t h = 8 + i % 12, w = 6 + (i * 7) % 14, y = 2 + i % 5, x = 3 + (i * 3) % 6;
    set.images[i].narrow(0, y, h).narrow(1, x, w).copy_(torch::randint(120, 256, {h, w}).to(torch::kUInt8));
  }
  return set;
}

/// A configuration small enough for milliseconds per step (S = 16).
Pix2pixConfig tiny(const std::string& generator) { return capsnet::testing::tiny_pix2pix_config(generator); }

LabelMapOptions maps16() {
  LabelMapOptions o;
  o.size = 16;
  return o;
}

}  // namespace

// ---- data ---------------------------------------------------------------------------------------

TEST(CapsPix2pixData, LabelMapOfASquare) {
  auto ink = torch::zeros({1, 1, 8, 8});
  ink[0][0].narrow(0, 1, 5).narrow(1, 2, 5).fill_(1);  // 5x5 square
  ink[0][0][7][7] = 1;                                 // a lone corner pixel: touches the border, so edge
  auto m = capsnet::data::label_map_of(ink, 0.5);
  EXPECT_EQ((m == capsnet::data::kLabelInterior).sum().item<int64_t>(), 9);  // the 3x3 inside
  EXPECT_EQ((m == capsnet::data::kLabelEdge).sum().item<int64_t>(), 16 + 1);
  EXPECT_EQ((m == capsnet::data::kLabelBackground).sum().item<int64_t>(), 64 - 25 - 1);
  EXPECT_EQ(m[0][0][3][4].item<int64_t>(), capsnet::data::kLabelInterior);
  EXPECT_EQ(m[0][0][1][2].item<int64_t>(), capsnet::data::kLabelEdge);
}

TEST(CapsPix2pixData, InvariantsOfGeneratedPairs) {
  LabelMaps set(blob_set(30, 3), 5);
  auto b = set.generate(0, 20);
  ASSERT_EQ(b.maps.sizes(), (std::vector<int64_t>{20, 1, 32, 32}));
  ASSERT_EQ(b.one_hot.sizes(), (std::vector<int64_t>{20, 3, 32, 32}));
  ASSERT_EQ(b.images.sizes(), (std::vector<int64_t>{20, 1, 32, 32}));
  EXPECT_GE(b.maps.min().item<int64_t>(), 0);
  EXPECT_LE(b.maps.max().item<int64_t>(), 2);
  EXPECT_GE(b.images.min().item<float>(), -1.0f);
  EXPECT_LE(b.images.max().item<float>(), 1.0f);
  // One-hot agrees with the map; every class occurs.
  EXPECT_TRUE(torch::equal(b.one_hot.sum(1), torch::ones({20, 32, 32})));
  EXPECT_TRUE(torch::equal(b.one_hot.argmax(1, true), b.maps));
  for (int64_t k = 0; k < 3; ++k) EXPECT_GT((b.maps == k).sum().item<int64_t>(), 0) << "class " << k;
  // The map is a function of the image: background exactly where ink <= threshold.
  auto ink = (b.images + 1) / 2;  // back to [0, 1] (up to rounding)
  const double t = set.options().object_threshold;
  EXPECT_FALSE(((b.maps == 0) & (ink > t + 1e-6)).any().item<bool>());
  EXPECT_FALSE(((b.maps != 0) & (ink <= t - 1e-6)).any().item<bool>());
  // Interior pixels have no background among their 8 neighbours; edge pixels have one.
  auto bg = torch::constant_pad_nd((b.maps == 0).to(torch::kFloat), {1, 1, 1, 1}, 1.0);
  auto near_bg = torch::max_pool2d(bg, {3, 3}, {1, 1}) > 0.5;
  EXPECT_FALSE((near_bg & (b.maps == 1)).any().item<bool>());
  EXPECT_FALSE(((b.maps == 2) & ~near_bg).any().item<bool>());
  EXPECT_TRUE(torch::equal(b.labels, b.sources % 10));
}

TEST(CapsPix2pixData, DeterministicStreamedAndSeeded) {
  auto source = blob_set(30, 3);
  LabelMaps a(source, 9), again(source, 9), other(source, 10);
  auto whole = a.generate(0, 12), part = again.generate(5, 4);
  EXPECT_TRUE(torch::equal(whole.images.narrow(0, 5, 4), part.images));  // example n depends on (seed, n) only
  EXPECT_TRUE(torch::equal(whole.maps.narrow(0, 5, 4), part.maps));
  EXPECT_FALSE(torch::equal(whole.sources, other.generate(0, 12).sources));
  // Flips happen (some images are mirrored copies of their source).
  int64_t flipped = 0;
  LabelMapOptions no_flip;
  no_flip.flip = false;
  LabelMaps plain(source, 9, no_flip);
  auto p = plain.generate(0, 12);
  EXPECT_TRUE(torch::equal(p.sources, whole.sources));
  for (int64_t i = 0; i < 12; ++i) flipped += !torch::equal(p.images[i], whole.images[i]);
  EXPECT_GT(flipped, 0);
  EXPECT_LT(flipped, 12);
  EXPECT_THROW(a.generate(-1, 2), std::invalid_argument);
  EXPECT_THROW(a.generate(0, 0), std::invalid_argument);
  LabelMapOptions bad;
  bad.object_threshold = 1;
  EXPECT_THROW(LabelMaps(source, 1, bad), std::invalid_argument);
}

// ---- models -------------------------------------------------------------------------------------

TEST(CapsPix2pixModel, ShapesRangeAndNoiseDependence) {
  capsnet::testing::ScopedThreads one(1);
  torch::manual_seed(1);
  for (const std::string g : {"caps", "cnn"}) {
    SCOPED_TRACE(g);
    Pix2pix m(tiny(g));
    LabelMaps set(blob_set(10, 1), 2, maps16());
    auto b = set.generate(0, 3);
    auto z = torch::randn({3, 2});
    auto y = m->generate(b.one_hot, z);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 1, 16, 16}));
    EXPECT_LT(y.abs().max().item<float>(), 1.0f);  // tanh
    EXPECT_EQ(m->discriminator->forward(b.one_hot, y).sizes(), (std::vector<int64_t>{3, 1, 4, 4}));
    // z reaches the image.
    EXPECT_GT((m->generate(b.one_hot, z + 1) - y).abs().max().item<float>(), 1e-4);
    EXPECT_THROW(m->generate(b.one_hot, torch::randn({3, 5})), std::invalid_argument);
    EXPECT_THROW(m->generate(b.one_hot.narrow(1, 0, 2), z), std::invalid_argument);
    EXPECT_THROW(m->discriminator->forward(b.one_hot, torch::zeros({3, 1, 8, 8})), std::invalid_argument);
  }
  auto bad = tiny("cnn");
  bad.image_size = 20;  // four stride-2 levels need a multiple of 16
  EXPECT_THROW(bad.validate(), std::invalid_argument);
  bad = tiny("gan");
  EXPECT_THROW(bad.validate(), std::invalid_argument);
  // The config round-trips through JSON (checkpoints).
  auto c = tiny("caps");
  EXPECT_EQ(Pix2pixConfig::from_json(c.to_json()).to_json(), c.to_json());
}

TEST(CapsPix2pixModel, ParameterCountsMatchTheLayers) {
  Pix2pix caps{Pix2pixConfig{}}, cnn{[] {
    Pix2pixConfig c;
    c.generator = "cnn";
    return c;
  }()};
  auto count = [](const std::vector<torch::Tensor>& ps) {
    int64_t n = 0;
    for (const auto& p : ps) n += p.numel();
    return n;
  };
  // PatchGAN (D = 64, K = 3): conv4 4->64, conv4 64->128 + BN, conv3 128->1.
  const int64_t d = (4 * 16 * 64 + 64) + (64 * 16 * 128 + 128) + 2 * 128 + (128 * 9 + 1);
  EXPECT_EQ(count(caps->discriminator_parameters()), d);
  EXPECT_EQ(count(cnn->discriminator_parameters()), d);
  // The capsule generator is much smaller than the U-net (as in the paper).
  EXPECT_LT(count(caps->generator_parameters()) * 4, count(cnn->generator_parameters()));
  EXPECT_EQ(count(caps->parameters()), count(caps->generator_parameters()) + d);
}

TEST(CapsPix2pixModel, Float64GradcheckTinyCapsuleGenerator) {
  torch::manual_seed(7);
  auto c = tiny("caps");
  c.image_size = 4;
  c.z_dim = 1;
  c.stem_channels = 2;
  c.primary_types = 1;
  c.primary_atoms = 2;
  c.types = 2;
  c.atoms = 2;
  c.out_atoms = 2;
  capsnet::models::CapsGenerator g(c);
  g->set_fused_routing(false);
  g->to(torch::kDouble);
  auto labels = torch::rand({1, 3, 4, 4}, torch::kDouble);
  auto z = torch::randn({1, 1}, torch::kDouble).requires_grad_();
  auto fn = [&](const std::vector<torch::Tensor>& in) { return g->forward(in[0], in[1]); };
  EXPECT_TRUE(capsnet::testing::gradcheck(fn, {labels.requires_grad_(), z}));
  // Weights of a routed layer and of the stem too.
  EXPECT_TRUE(capsnet::testing::gradcheck([&](const std::vector<torch::Tensor>&) { return g->forward(labels, z); },
                                           {g->bottom->weight, g->stem->weight}));
}

TEST(CapsPix2pixModel, GradientsReachBothNetworks) {
  capsnet::testing::ScopedThreads one(1);
  torch::manual_seed(2);
  for (const std::string gen : {"caps", "cnn"}) {
    SCOPED_TRACE(gen);
    Pix2pix m(tiny(gen));
    LabelMaps set(blob_set(10, 1), 2, maps16());
    auto b = set.generate(0, 4);
    auto fake = m->generate(b.one_hot, torch::randn({4, 2}));
    auto d = m->discriminator_loss(b.one_hot, b.images, fake);
    d.backward();
    for (const auto& p : m->generator_parameters()) EXPECT_FALSE(p.grad().defined());  // fake is detached
    double dnorm = 0;
    for (const auto& p : m->discriminator_parameters()) dnorm += p.grad().abs().sum().item<double>();
    EXPECT_GT(dnorm, 0);
    auto l = m->generator_losses(b.one_hot, b.images, fake);
    EXPECT_NEAR(l.generator.item<double>(), l.generator_gan.item<double>() + 100 * l.l1.item<double>(), 1e-3);
    l.generator.backward();
    for (const auto& item : m->named_parameters())
      if (item.key().rfind("generator.", 0) == 0) EXPECT_TRUE(item.value().grad().defined()) << item.key();
  }
}

// ---- training -----------------------------------------------------------------------------------

TEST(CapsPix2pixTrain, DiscriminatorUpdateLeavesTheGeneratorAlone) {
  capsnet::testing::ScopedThreads one(1);
  torch::manual_seed(3);
  Pix2pix m(tiny("caps"));
  auto opt = capsnet::experiments::make_pix2pix_optimizer(m, 2e-4, 0.5);
  ASSERT_EQ(opt->param_groups().size(), 2u);
  EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(opt->param_groups()[0].options()).betas(),
            std::make_tuple(0.5, 0.999));
  LabelMaps set(blob_set(10, 1), 2, maps16());
  auto b = set.generate(0, 4);
  auto z = torch::randn({4, 2});
  std::vector<torch::Tensor> g0, d0;
  for (const auto& p : m->generator_parameters()) g0.push_back(p.detach().clone());
  for (const auto& p : m->discriminator_parameters()) d0.push_back(p.detach().clone());
  // Two full steps move both; the generator's Adam moments start only with its own update.
  capsnet::experiments::pix2pix_step(m, *opt, b.one_hot, b.images, z);
  auto gp = m->generator_parameters(), dp = m->discriminator_parameters();
  bool g_moved = false, d_moved = false;
  for (size_t i = 0; i < gp.size(); ++i) g_moved |= !torch::equal(gp[i], g0[i]);
  for (size_t i = 0; i < dp.size(); ++i) d_moved |= !torch::equal(dp[i], d0[i]);
  EXPECT_TRUE(g_moved);
  EXPECT_TRUE(d_moved);
  // A discriminator-only update (the first half of a step) keeps every generator weight.
  g0.clear();
  for (const auto& p : gp) g0.push_back(p.detach().clone());
  for (const auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
  m->discriminator_loss(b.one_hot, b.images, m->generate(b.one_hot, z)).backward();
  opt->step();
  for (size_t i = 0; i < gp.size(); ++i) EXPECT_TRUE(torch::equal(gp[i], g0[i])) << "generator weight " << i;
}

TEST(CapsPix2pixTrain, OneStepLowersTheGeneratorL1OnAFixedBatch) {
  capsnet::testing::ScopedThreads one(1);
  for (const std::string gen : {"caps", "cnn"}) {
    SCOPED_TRACE(gen);
    torch::manual_seed(4);
    Pix2pix m(tiny(gen));
    auto opt = capsnet::experiments::make_pix2pix_optimizer(m, 2e-4, 0.5);
    LabelMaps set(blob_set(10, 1), 2, maps16());
    auto b = set.generate(0, 8);
    auto z = torch::randn({8, 2});
    auto l1 = [&] {
      torch::NoGradGuard ng;
      return (m->generate(b.one_hot, z) - b.images).abs().mean().item<double>();
    };
    const double before = l1();
    auto losses = capsnet::experiments::pix2pix_step(m, *opt, b.one_hot, b.images, z);
    EXPECT_NEAR(losses.l1.item<double>(), before, 1e-6);  // the step saw the same batch
    EXPECT_LT(l1(), before);
  }
}

// MSGAN's mode-seeking term: the ratio is mean |a - b| / mean |z_a - z_b|; the step reports it for G(x, z)
// and G(x, z rolled by one row) at the generator's weights before the step; when the term dominates the
// generator's loss, one step makes different noise give more different images; bad settings are refused.
TEST(CapsPix2pixTrain, ModeSeekingTermRewardsNoiseThatChangesTheImage) {
  using capsnet::experiments::mode_seeking_ratio;
  const auto a = torch::tensor({1.0, 2.0}).view({1, 1, 1, 2}), b = torch::tensor({0.0, 4.0}).view({1, 1, 1, 2});
  const auto za = torch::tensor({0.0, 0.0}).view({1, 2}), zb = torch::tensor({1.0, 3.0}).view({1, 2});
  EXPECT_DOUBLE_EQ(mode_seeking_ratio(a, b, za, zb).item<double>(), 1.5 / 2.0);

  capsnet::testing::ScopedThreads one(1);
  torch::manual_seed(5);
  Pix2pix m(tiny("caps"));
  auto opt = capsnet::experiments::make_pix2pix_optimizer(m, 2e-4, 0.5);
  LabelMaps set(blob_set(10, 1), 2, maps16());
  auto b8 = set.generate(0, 8);
  const auto z = torch::randn({8, 2}), z2 = z.roll(1, 0);
  auto ratio_now = [&] {
    torch::NoGradGuard ng;
    return mode_seeking_ratio(m->generate(b8.one_hot, z), m->generate(b8.one_hot, z2), z, z2).item<double>();
  };
  const double before = ratio_now();
  torch::Tensor reported;
  capsnet::experiments::pix2pix_step(m, *opt, b8.one_hot, b8.images, z, /*mode_seeking=*/1e3, &reported);
  ASSERT_TRUE(reported.defined());
  EXPECT_NEAR(reported.item<double>(), before, 1e-6 * before);
  EXPECT_GT(ratio_now(), before);
  torch::Tensor untouched;
  capsnet::experiments::pix2pix_step(m, *opt, b8.one_hot, b8.images, z, 0, &untouched);
  EXPECT_FALSE(untouched.defined()) << "off: no second generator pass";

  capsnet::experiments::Pix2pixTrainOptions o;
  o.model = tiny("caps");
  o.mode_seeking = -1;
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o.mode_seeking = 1;
  EXPECT_NO_THROW(o.validate());
  o.loop.batch_size = 1;
  EXPECT_THROW(o.validate(), std::invalid_argument);
  o.loop.batch_size = 2;
  o.model.z_dim = 0;
  EXPECT_THROW(o.validate(), std::invalid_argument);
}

TEST(CapsPix2pixTrain, LoopTrainsResumesExactlyAndEvaluates) {
  capsnet::testing::ScopedThreads one(1);
  capsnet::testing::TempDir dir;
  LabelMaps train_set(blob_set(20, 1), 2, maps16()), test_set(blob_set(10, 5), 3, maps16());
  capsnet::experiments::Pix2pixTrainOptions o;
  o.model = tiny("caps");
  o.loop.out_dir = dir / "straight";  // the experiment's own loop defaults otherwise
  o.loop.max_steps = 4;
  o.loop.batch_size = 3;
  o.loop.log_every = 1;
  o.loop.progress = false;
  o.test_size = 4;
  o.eval_batch_size = 2;
  o.diversity_maps = 2;
  o.diversity_samples = 3;
  std::ostringstream log;
  auto straight = capsnet::experiments::train_pix2pix(o, train_set, test_set, log);
  EXPECT_EQ(straight.steps, 4);
  EXPECT_EQ(straight.test.examples, 4);
  EXPECT_GT(straight.test.l1, 0);
  EXPECT_GT(straight.test.diversity, 0);  // z changes the images
  EXPECT_GT(straight.test.ssim, -1);
  EXPECT_LE(straight.test.ssim, 1);
  EXPECT_NE(log.str().find("PatchGAN discriminator"), std::string::npos) << log.str();
  {
    std::ifstream metrics(capsnet::train::metrics_path(o.loop.out_dir));
    std::string start, train;
    std::getline(metrics, start);
    std::getline(metrics, train);
    auto r = nlohmann::json::parse(train);
    for (const char* key : {"d_loss", "g_gan", "l1", "loss"}) EXPECT_TRUE(r.contains(key)) << train;
  }
  // 2 steps, then resume to 4: the same weights as 4 straight (both networks, Adam state, z stream).
  o.loop.out_dir = dir / "half";
  o.loop.max_steps = 2;
  capsnet::experiments::train_pix2pix(o, train_set, test_set, log);
  o.loop.max_steps = 4;
  o.loop.resume = capsnet::train::checkpoint_path(dir / "half");
  auto resumed = capsnet::experiments::train_pix2pix(o, train_set, test_set, log);
  auto a = straight.model->parameters(), b = resumed.model->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::allclose(a[i], b[i], 1e-6, 1e-7)) << "parameter " << i;
  // The mode-seeking weight is part of the run: resuming the λ = 0 run with the term is refused.
  {
    auto other = o;
    other.mode_seeking = 0.5;
    other.loop.out_dir = dir / "other";
    try {
      capsnet::experiments::train_pix2pix(other, train_set, test_set, log);
      ADD_FAILURE() << "resumed with another --mode-seeking";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("option mode_seeking is 0.0 in the checkpoint but 0.5 now"),
                std::string::npos)
          << e.what();
    }
  }
  // The checkpoint loads back into a model that generates the same images.
  auto loaded = capsnet::experiments::load_pix2pix(capsnet::train::checkpoint_path(o.loop.out_dir));
  auto batch = test_set.generate(0, 2);
  auto z = capsnet::experiments::eval_noise(7, 0, 2, 2);
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::allclose(loaded->generate(batch.one_hot, z), resumed.model->generate(batch.one_hot, z)));
}

// With a validation set the loop keeps the lowest validation L1 as best.pt and the test maps are scored
// with it; patience needs a validation set.
TEST(CapsPix2pixTrain, ValidationKeepsTheLowestL1AndTheTestScoresThatCheckpoint) {
  capsnet::testing::ScopedThreads one(1);
  capsnet::testing::TempDir dir;
  LabelMaps train_set(blob_set(20, 1), 2, maps16()), test_set(blob_set(10, 5), 3, maps16()),
      val_set(blob_set(10, 6), 4, maps16());
  capsnet::experiments::Pix2pixTrainOptions o;
  o.model = tiny("cnn");
  o.loop.out_dir = dir / "val";
  o.loop.max_steps = 6;
  o.loop.batch_size = 3;
  o.loop.lr = 2e-2;  // large: the validation L1 moves from step to step
  o.loop.progress = false;
  o.loop.eval_every = 1;
  o.test_size = 4;
  o.eval_batch_size = 2;
  o.diversity_maps = 2;
  o.diversity_samples = 3;
  o.validation_size = 3;
  std::ostringstream log;
  EXPECT_THROW(capsnet::experiments::train_pix2pix(o, train_set, test_set, log), std::invalid_argument)
      << "validation_size without a validation set";
  auto r = capsnet::experiments::train_pix2pix(o, train_set, test_set, log, &val_set);
  ASSERT_TRUE(r.best_validation_l1.has_value());
  EXPECT_EQ(r.scored_checkpoint, capsnet::train::best_checkpoint_path(o.loop.out_dir));
  // The best is the lowest validation L1 of the six "eval" records of the validation split.
  std::ifstream metrics(capsnet::train::metrics_path(o.loop.out_dir));
  double lowest = 1e9;
  int64_t lowest_step = -1, validations = 0;
  for (std::string line; std::getline(metrics, line);) {
    auto rec = nlohmann::json::parse(line);
    if (rec["event"] != "eval" || rec["split"] != "val") continue;
    ++validations;
    EXPECT_EQ(rec["l1"], rec["loss"]);
    if (rec["loss"].get<double>() < lowest) {
      lowest = rec["loss"].get<double>();
      lowest_step = rec["step"].get<int64_t>();
    }
  }
  EXPECT_EQ(validations, 6);
  EXPECT_EQ(*r.best_validation_l1, lowest);
  EXPECT_EQ(r.best_validation_step, lowest_step);
  EXPECT_EQ(capsnet::train::read_checkpoint_meta(r.scored_checkpoint).step, lowest_step);
  // The reported test scores are best.pt's.
  auto best = capsnet::experiments::load_pix2pix(r.scored_checkpoint);
  auto again = capsnet::experiments::evaluate_pix2pix(best, test_set, 4, 2, o.eval_seed, 2, 3);
  EXPECT_NEAR(r.test.l1, again.l1, 1e-6);
  EXPECT_NEAR(r.test.diversity, again.diversity, 1e-6);

  auto bad = o;
  bad.validation_size = 0;
  bad.loop.patience_steps = 2;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
  bad.validation_size = -1;
  bad.loop.patience_steps = 0;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
}

namespace {

/// A task that makes its own updates (as the GAN does) with its own optimizer: records the learning
/// rates the loop hands it and reports a NaN discriminator loss at step `nan_at`.
class SelfSteppingTask : public capsnet::train::Task {
 public:
  explicit SelfSteppingTask(int64_t nan_at) : nan_at_(nan_at) {}
  std::string name() const override { return "self-stepping"; }
  std::shared_ptr<torch::nn::Module> build_model(capsnet::Precision) override {
    model_ = torch::nn::Linear(1, 1);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return {{"linear", 1}}; }
  nlohmann::json data_config() const override { return nlohmann::json::object(); }
  std::string describe() const override { return "linear"; }
  int64_t epoch_size() const override { return 100; }
  bool shuffle() const override { return false; }
  capsnet::train::Batch batch(const torch::Tensor& ids, at::Generator&) const override {
    return {{ids.to(torch::kFloat).unsqueeze(1)}};
  }
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(torch::nn::Module& m,
                                                          const capsnet::train::LoopOptions&) override {
    return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(1.0));
  }
  bool steps_itself() const override { return true; }
  capsnet::train::TaskLoss train_step(const capsnet::train::Batch& rows, torch::optim::Optimizer& opt) override {
    lrs.push_back(opt.param_groups()[0].options().get_lr());
    opt.zero_grad();
    auto loss = model_->forward(rows[0]).pow(2).mean() * 1e-6;
    loss.backward();
    opt.step();
    const double d = steps_++ == nan_at_ ? std::nan("") : 0.0;
    return {loss.detach(), {{"d_loss", torch::tensor(d)}}};
  }
  capsnet::train::TaskLoss loss(const capsnet::train::Batch&) override {
    ADD_FAILURE() << "loss() must not be called for a task that steps itself";
    return {};
  }
  std::vector<double> lrs;

 private:
  torch::nn::Linear model_{nullptr};
  int64_t nan_at_, steps_ = 0;
};

}  // namespace

TEST(CapsPix2pixTrain, LoopRunsSelfSteppingTasksWithTheirOptimizerAndNanGuard) {
  capsnet::testing::TempDir dir;
  auto o = capsnet::testing::quiet_loop(dir.str(), 2);
  o.epochs = 0;
  o.max_steps = 5;
  o.lr = 0.125;
  o.lr_decay = 1;
  o.checkpoint_every = 1;
  std::ostringstream log;
  SelfSteppingTask fine(-1);
  auto r = capsnet::train::run(fine, o, log);
  EXPECT_EQ(r.end_step, 5);
  EXPECT_EQ(fine.lrs, std::vector<double>(5, 0.125));  // the loop set the task's optimizer's rate
  SelfSteppingTask bad(2);
  try {
    capsnet::train::run(bad, o, log);
    FAIL() << "a NaN scalar must stop the run";
  } catch (const capsnet::train::TrainingDiverged& e) {
    EXPECT_NE(std::string(e.what()).find("d_loss is nan at step 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(capsnet::train::read_checkpoint_meta(capsnet::train::checkpoint_path(o.out_dir)).step, 2);
}

// ---- scores and figures -------------------------------------------------------------------------

TEST(CapsPix2pixEval, ScoresOnKnownImages) {
  torch::manual_seed(5);
  auto x = torch::rand({3, 1, 16, 16});
  auto ssim_same = capsnet::experiments::ssim_per_image(x, x);
  EXPECT_TRUE(torch::allclose(ssim_same, torch::ones({3}, torch::kFloat64), 1e-9, 1e-9));
  EXPECT_TRUE(torch::allclose(capsnet::experiments::psnr_per_image(x, x), torch::full({3}, 100.0, torch::kFloat64)));
  auto y = (x + 0.1).clamp(0, 1);
  auto noisy = (x + 0.3 * torch::randn_like(x)).clamp(0, 1);
  EXPECT_TRUE((capsnet::experiments::ssim_per_image(x, noisy) < 0.9).all().item<bool>());
  auto half = torch::full({1, 1, 16, 16}, 0.5), zero = torch::zeros({1, 1, 16, 16});
  EXPECT_NEAR(capsnet::experiments::l1_per_image(half, zero).item<double>(), 0.5, 1e-9);
  EXPECT_NEAR(capsnet::experiments::psnr_per_image(half, zero).item<double>(), 10 * std::log10(4.0), 1e-6);
  EXPECT_GT(capsnet::experiments::psnr_per_image(x, y).mean().item<double>(),
            capsnet::experiments::psnr_per_image(x, noisy).mean().item<double>());
  EXPECT_NEAR(capsnet::experiments::mean_pairwise_l1(torch::cat({zero, half, zero})), (0.5 + 0 + 0.5) / 3, 1e-9);
  EXPECT_THROW(capsnet::experiments::ssim_per_image(torch::zeros({1, 1, 8, 8}), torch::zeros({1, 1, 8, 8})),
               std::invalid_argument);
  // Evaluation noise: a function of (seed, index) only.
  EXPECT_TRUE(torch::equal(capsnet::experiments::eval_noise(3, 0, 5, 4).narrow(0, 2, 3), capsnet::experiments::eval_noise(3, 2, 3, 4)));
  EXPECT_FALSE(torch::equal(capsnet::experiments::eval_noise(3, 0, 2, 4), capsnet::experiments::eval_noise(4, 0, 2, 4)));
}

TEST(CapsPix2pixEval, LabelConsistencyCountsTheClassifiersAgreementWithTheSourceClass) {
  // Reference written out step by step, one map at a time: generate with map i's noise, map to
  // [0, 1], resize 16 -> 12 bilinearly, take the longest capsule, compare with the source's label.
  torch::manual_seed(2);
  capsnet::models::Pix2pix model{tiny("cnn")};
  capsnet::models::CapsNet classifier{capsnet::testing::tiny_config()};  // 12 x 12, 10 classes
  LabelMaps set(blob_set(40, 3), 9, maps16());
  const int64_t count = 7;
  const uint64_t eval_seed = 7;
  auto score = capsnet::experiments::label_consistency(model, classifier, set, count, 3, eval_seed);
  torch::NoGradGuard no_grad;
  classifier->eval();
  int64_t generated = 0, real = 0;
  std::vector<int64_t> predicted;
  for (int64_t i = 0; i < count; ++i) {
    auto b = set.generate(i, 1);
    auto resize = [](const torch::Tensor& x) {
      return torch::upsample_bilinear2d(x, {12, 12}, /*align_corners=*/false);
    };
    auto fake = ((model->generate(b.one_hot, capsnet::experiments::eval_noise(eval_seed, i, 1, 2)) + 1) / 2).clamp(0, 1);
    const int64_t label = b.labels.item<int64_t>();
    const int64_t pf = classifier->forward(resize(fake)).lengths.argmax(1).item<int64_t>();
    const int64_t pr = classifier->forward(resize(((b.images + 1) / 2).clamp(0, 1))).lengths.argmax(1).item<int64_t>();
    generated += pf == label;
    real += pr == label;
    predicted.push_back(pf);
  }
  EXPECT_EQ(score.examples, count);
  EXPECT_DOUBLE_EQ(score.generated, static_cast<double>(generated) / count);
  EXPECT_DOUBLE_EQ(score.real, static_cast<double>(real) / count);
  // The batch-wise prediction helper agrees with the one-at-a-time reference.
  auto b = set.generate(0, count);
  auto fake = ((model->generate(b.one_hot, capsnet::experiments::eval_noise(eval_seed, 0, count, 2)) + 1) / 2).clamp(0, 1);
  auto batch_pred = capsnet::experiments::classify_resized(classifier, fake);
  for (int64_t i = 0; i < count; ++i) EXPECT_EQ(batch_pred[i].item<int64_t>(), predicted[i]) << i;
  // A classifier that cannot take the images, or cannot name their classes, is refused by name.
  auto rgb = capsnet::testing::tiny_config();
  rgb.image_channels = 3;
  capsnet::models::CapsNet rgb_classifier{rgb};
  try {
    capsnet::experiments::label_consistency(model, rgb_classifier, set, 2, 2, eval_seed);
    FAIL() << "a 3-channel classifier was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("3 channels"), std::string::npos) << e.what();
  }
  auto few = capsnet::testing::tiny_config();
  few.num_classes = 2;
  capsnet::models::CapsNet few_classifier{few};
  try {
    capsnet::experiments::label_consistency(model, few_classifier, set, 10, 5, eval_seed);  // labels 0..9
    FAIL() << "a 2-class classifier was accepted for 10 classes";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2 classes"), std::string::npos) << e.what();
  }
}

TEST(CapsPix2pixFigures, SizesContentsAndPng) {
  capsnet::testing::ScopedThreads one(1);
  torch::manual_seed(6);
  Pix2pix caps(tiny("caps")), cnn(tiny("cnn"));
  LabelMaps set(blob_set(10, 1), 2, maps16());
  const int64_t z = 2, tile = 16 * z + 2;
  auto cmp = capsnet::experiments::pix2pix_comparison_figure({cnn, caps}, set, 0, 3, 7, z);
  ASSERT_EQ(cmp.sizes(), (std::vector<int64_t>{3 * tile + 2, 4 * tile + 2}));
  // Column 0 is the label map (grey levels 0, 0.5, 1), the last column the real image.
  auto b = set.generate(0, 3);
  auto label_tile = cmp.narrow(0, 2, 16 * z).narrow(1, 2, 16 * z).index({torch::indexing::Slice(0, torch::indexing::None, z),
                                                                          torch::indexing::Slice(0, torch::indexing::None, z)});
  EXPECT_TRUE(torch::allclose(label_tile, b.maps[0][0].to(torch::kFloat) / 2));
  auto real_tile = cmp.narrow(0, 2, 16 * z).narrow(1, 2 + 3 * tile, 16 * z).index(
      {torch::indexing::Slice(0, torch::indexing::None, z), torch::indexing::Slice(0, torch::indexing::None, z)});
  EXPECT_TRUE(torch::allclose(real_tile, (b.images[0][0] + 1) / 2, 1e-6, 1e-6));
  auto var = capsnet::experiments::pix2pix_variations_figure({cnn, caps}, set, 1, 5, 7, z);
  EXPECT_EQ(var.sizes(), (std::vector<int64_t>{2 * tile + 2, 6 * tile + 2}));
  auto interp = capsnet::experiments::pix2pix_interpolation_figure({caps}, set, 1, 6, 7, z);
  EXPECT_EQ(interp.sizes(), (std::vector<int64_t>{tile + 2, 7 * tile + 2}));
  // The strip's samples differ from one another (z moves the image).
  auto first = interp.narrow(1, 2 + tile, 16 * z), last = interp.narrow(1, 2 + 6 * tile, 16 * z);
  EXPECT_GT((first - last).abs().max().item<float>(), 1e-4);
  capsnet::testing::TempDir dir;
  capsnet::viz::write_png_gray(dir / "c.png", cmp);
  auto back = capsnet::viz::read_png_gray(dir / "c.png");
  EXPECT_EQ(back.sizes(), cmp.sizes());
  EXPECT_THROW(capsnet::experiments::pix2pix_comparison_figure({}, set, 0, 3, 7), std::invalid_argument);
  EXPECT_THROW(capsnet::experiments::pix2pix_interpolation_figure({caps}, set, 0, 1, 7), std::invalid_argument);
}

// ---- CLI ----------------------------------------------------------------------------------------

TEST(CapsPix2pixCli, TrainsBothGeneratorsAndDrawsThemSideBySide) {
  capsnet::testing::TempDir dir;
  capsnet::testing::write_fake_mnist(dir / "data", 30, 20);
  const std::string common = " --data " + (dir / "data") +
                             " --steps 2 --batch-size 2 --test-size 3 --figure-rows 2 --log-every 1 --no-progress "
                             "--threads 1";
  // The pix2pix generator narrowed to about the capsule generator's size (the matched-parameter row).
  // It also holds out 4 training images for validation: the test maps score its best-validation checkpoint.
  auto r = capsnet::testing::run_command(
      kCli + " capspix2pix --generator cnn --cnn-channels 9 --val 4 --eval-every 1 --out " + (dir / "cnn") + common);
  ASSERT_EQ(r.status, 0) << r.output;
  // A small CapsNet on the same 28 x 28 source images scores label consistency (maps are 32 x 32).
  r = capsnet::testing::run_command(kCli + " train --data " + (dir / "data") + " --out " + (dir / "classifier") +
                                    " --steps 1 --batch-size 4 --conv1-channels 8 --primary-types 2 --no-eval "
                                    "--no-progress --threads 1");
  ASSERT_EQ(r.status, 0) << r.output;
  r = capsnet::testing::run_command(kCli + " capspix2pix --generator caps --mode-seeking 1 --out " + (dir / "caps") +
                                    common + " --compare-with " + capsnet::train::checkpoint_path(dir / "cnn") +
                                    " --classifier " + capsnet::train::checkpoint_path(dir / "classifier"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("caps generator, test (3 maps)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("label consistency (3 maps"), std::string::npos) << r.output;
  std::ifstream in(dir / "caps/capspix2pix.json");
  auto j = nlohmann::json::parse(in);
  for (const char* k : {"generated", "real"}) {
    const double v = j["test"]["label_consistency"][k].get<double>();
    EXPECT_TRUE(v == 0.0 || v == 1.0 / 3 || v == 2.0 / 3 || v == 1.0) << k << " " << v;  // a share of 3 maps
  }
  EXPECT_EQ(j["steps"], 2);
  EXPECT_EQ(j["generator"], "caps");
  EXPECT_EQ(j["l1_weight"], 100.0);
  EXPECT_EQ(j["beta1"], 0.5);
  EXPECT_EQ(j["lr"], 2e-4);
  EXPECT_EQ(j["mode_seeking"], 1.0);
  {
    std::ifstream metrics(dir / "caps/metrics.jsonl");
    int with_ratio = 0;
    for (std::string line; std::getline(metrics, line);) {
      const auto rec = nlohmann::json::parse(line);
      if (rec["event"] == "train") with_ratio += rec.contains("mode_seeking_ratio");
    }
    EXPECT_EQ(with_ratio, 2) << "both logged steps carry the mode-seeking ratio";
  }
  EXPECT_GT(j["generator_parameters"].get<int64_t>(), 0);
  EXPECT_EQ(j["test"]["maps"], 3);
  for (const char* f : {"capspix2pix_compare.png", "capspix2pix_variations.png", "capspix2pix_interpolation.png"})
    EXPECT_TRUE(std::filesystem::exists(dir / ("caps/" + std::string(f)))) << f;
  // Two models side by side: label | pix2pix | CapsPix2pix | real, 32x32 tiles at zoom 2.
  auto png = capsnet::viz::read_png_gray(dir / "caps/capspix2pix_compare.png");
  EXPECT_EQ(png.size(1), 4 * (64 + 2) + 2);
  EXPECT_NE(j["figures"]["capspix2pix_compare.png"].get<std::string>().find("label | pix2pix | CapsPix2pix | real"),
            std::string::npos);
  EXPECT_NE(j["figures"]["capspix2pix_variations.png"].get<std::string>().find("(pix2pix | CapsPix2pix)"),
            std::string::npos);
  // One model alone: its captions name it once, with no empty column.
  auto cnn = nlohmann::json::parse(std::ifstream(dir / "cnn/capspix2pix.json"));
  EXPECT_EQ(cnn["mode_seeking"], 0.0);
  EXPECT_EQ(cnn["model"]["cnn_channels"], 9);
  EXPECT_EQ(cnn["scored_checkpoint"], capsnet::train::best_checkpoint_path(dir / "cnn"));
  EXPECT_EQ(cnn["validation"]["maps"], 4);
  EXPECT_EQ(cnn["validation"]["eval_every"], 1);
  EXPECT_TRUE(cnn["validation"]["best_step"] == 1 || cnn["validation"]["best_step"] == 2) << cnn["validation"];
  EXPECT_GT(cnn["validation"]["best_l1"].get<double>(), 0.0);
  {
    capsnet::models::Pix2pixConfig narrow;  // the command's defaults, 9 channels
    narrow.generator = "cnn";
    narrow.cnn_channels = 9;
    int64_t n = 0;
    for (const auto& p : capsnet::models::Pix2pix(narrow)->generator_parameters()) n += p.numel();
    EXPECT_EQ(cnn["generator_parameters"].get<int64_t>(), n);
    EXPECT_EQ(n, 82621);  // the number --help quotes
  }
  EXPECT_NE(cnn["figures"]["capspix2pix_compare.png"].get<std::string>().find("label | pix2pix | real"),
            std::string::npos);
  EXPECT_NE(cnn["figures"]["capspix2pix_variations.png"].get<std::string>().find("(pix2pix):"), std::string::npos);
  // Bad values are refused before any work.
  r = capsnet::testing::run_command(kCli + " capspix2pix --generator gan --out " + (dir / "x"));
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(capsnet::testing::FailsSaying(
      capsnet::testing::run_cli("capspix2pix --patience 5 --eval-every 10 --out " + (dir / "x")),
      "--patience needs --val N"));
  for (const std::string flag : {"--recon-weight=-1", "--mode-seeking=-1", "--cnn-channels=0", "--patience=-1"})
    EXPECT_TRUE(capsnet::testing::FailsSaying(
        capsnet::testing::run_cli("capspix2pix " + flag + " --out " + (dir / "x")), "out of range"))
        << flag;
  r = capsnet::testing::run_command(kCli + " capspix2pix --classifier " + (dir / "missing.pt") + " --out " +
                                    (dir / "y") + common);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("missing.pt"), std::string::npos) << r.output;
}
