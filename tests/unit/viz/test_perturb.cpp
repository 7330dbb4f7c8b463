// Capsule-dimension perturbations (paper Fig. 4): the decoded grid, its figure, bad input, and
// `capsnet perturb` end to end on a generated MNIST-format set.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "capsnet/data/idx.h"
#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/viz/figures.h"
#include "capsnet/viz/perturbation.h"
#include "capsnet/viz/png.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::run_command;
using testing::TempDir;

models::CapsNet tiny_model() {
  torch::manual_seed(7);
  auto config = testing::tiny_config();
  EXPECT_TRUE(config.reconstruction);  // the perturbation needs the decoder
  return models::CapsNet(config);
}

/// One synthetic digit: [1, side, side] float in [0, 1].
torch::Tensor synthetic_image(int64_t side, int64_t which = 3) {
  auto set = testing::synthetic_set(which + 1, side, 21);
  return data::to_float(set.images.narrow(0, which, 1))[0];
}

/// A 28x28 model with the paper's 16-D digit capsules but few channels (builds and runs in milliseconds).
models::CapsNetConfig narrow_mnist_config(bool reconstruction) {
  models::CapsNetConfig c;
  c.conv1_channels = 8;
  c.primary_types = 2;
  c.primary_dim = 4;
  c.reconstruction = reconstruction;
  return c;
}

void expect_error_mentions(const std::function<void()>& call, const std::string& phrase) {
  try {
    call();
    FAIL() << "expected an error mentioning \"" << phrase << "\"";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
  }
}

TEST(PerturbTest, DefaultOffsetsAreThePapersElevenSteps) {
  const auto offsets = viz::default_perturbation_offsets();
  ASSERT_EQ(offsets.size(), 11u);
  for (size_t i = 0; i < offsets.size(); ++i) EXPECT_NEAR(offsets[i], -0.25 + 0.05 * i, 1e-12) << i;
  EXPECT_EQ(offsets[5], 0.0);  // exactly: the middle column is the unmodified capsule
  EXPECT_EQ(viz::offset_label(-0.25), "-.25");
  EXPECT_EQ(viz::offset_label(offsets[5]), "0");
  EXPECT_EQ(viz::offset_label(0.05), "+.05");
  EXPECT_EQ(viz::offset_label(1.5), "+1.50");
  EXPECT_EQ(viz::symmetric_offsets(0.5, 2), (std::vector<double>{-0.5, -0.25, 0.0, 0.25, 0.5}));
}

TEST(PerturbTest, ZeroOffsetColumnIsThePlainReconstruction) {
  auto model = tiny_model();
  const int64_t S = model->config.image_size, D = model->config.digit_dim;
  auto image = synthetic_image(S);
  model->train();  // perturb_capsule must switch to eval and back
  auto p = viz::perturb_capsule(model, image);
  EXPECT_TRUE(model->is_training());
  ASSERT_EQ(p.reconstructions.sizes(), (std::vector<int64_t>{D, 11, S, S}));
  EXPECT_FALSE(p.reconstructions.requires_grad());

  model->eval();
  torch::NoGradGuard no_grad;
  auto out = model(image.unsqueeze(0));  // decodes the longest capsule
  EXPECT_TRUE(torch::allclose(p.digit_caps, out.digit_caps[0], 0, 1e-6));
  EXPECT_EQ(p.prediction, out.lengths.argmax(1).item<int64_t>());
  EXPECT_EQ(p.capsule, p.prediction);
  auto plain = out.reconstruction.view({S, S});
  for (int64_t d = 0; d < D; ++d)
    EXPECT_LE((p.reconstructions[d][5] - plain).abs().max().item<double>(), 1e-6) << "dimension " << d;
  // The other columns really are perturbed.
  EXPECT_GT((p.reconstructions.select(1, 0) - p.reconstructions.select(1, 10)).abs().max().item<double>(), 1e-5);
}

TEST(PerturbTest, EachCellDecodesTheCapsuleModifiedByHand) {
  auto model = tiny_model();
  const int64_t S = model->config.image_size, D = model->config.digit_dim;
  auto image = synthetic_image(S, 7);
  viz::PerturbationOptions options;
  options.capsule = 7;  // the label's capsule, whatever the untrained model predicts
  auto p = viz::perturb_capsule(model, image, options);
  ASSERT_EQ(p.capsule, 7);
  torch::NoGradGuard no_grad;
  for (int64_t d = 0; d < D; ++d) {
    auto v = p.digit_caps.clone();  // [J, D]
    v[7][d] += 0.05;
    auto by_hand = model->decode(v.unsqueeze(0), torch::full({1}, 7, torch::kLong)).view({S, S});
    EXPECT_LE((p.reconstructions[d][6] - by_hand).abs().max().item<double>(), 1e-6) << "dimension " << d;
    EXPECT_GT((p.reconstructions[d][6] - p.reconstructions[d][5]).abs().max().item<double>(), 1e-7) << d;
  }
  // Sensitivity is the mean |r(+0.25) - r(-0.25)| per dimension.
  auto change = viz::dimension_sensitivity(p);
  ASSERT_EQ(change.sizes(), (std::vector<int64_t>{D}));
  for (int64_t d = 0; d < D; ++d)
    EXPECT_NEAR(change[d].item<double>(),
                (p.reconstructions[d][10] - p.reconstructions[d][0]).abs().mean().item<double>(), 1e-7);
}

TEST(PerturbTest, FigureHasTheDocumentedSizeAndSurvivesPng) {
  torch::manual_seed(3);
  models::CapsNet model(narrow_mnist_config(true));
  auto p = viz::perturb_capsule(model, synthetic_image(28)[0]);  // [28, 28] is accepted too
  ASSERT_EQ(p.reconstructions.sizes(), (std::vector<int64_t>{16, 11, 28, 28}));

  // zoom 2: 56-px cells, 2 px apart; caption scale 2: a 14-px band on top, "15" + 4 px on the left.
  auto figure = viz::perturbation_figure(p);
  const int64_t top = 5 * 2 + 4, left = viz::text_width("15", 2) + 4;
  ASSERT_EQ(figure.size(0), top + 16 * (56 + 2) + 2);
  ASSERT_EQ(figure.size(1), left + 11 * (56 + 2) + 2);
  // Row 3, column 8 starts at (top + 2 + 3*58, left + 2 + 8*58) and is the reconstruction zoomed 2x.
  const int64_t y = top + 2 + 3 * 58, x = left + 2 + 8 * 58;
  auto cell = figure.narrow(0, y, 56).narrow(1, x, 56);
  EXPECT_TRUE(torch::equal(cell, p.reconstructions[3][8].repeat_interleave(2, 0).repeat_interleave(2, 1)));
  EXPECT_GT(figure.narrow(0, 0, top).sum().item<float>(), 0.0f);   // offsets drawn
  EXPECT_GT(figure.narrow(1, 0, left).sum().item<float>(), 0.0f);  // dimension numbers drawn

  TempDir dir;
  viz::write_png_gray(dir / "p.png", figure);
  auto back = viz::read_png_gray(dir / "p.png");
  ASSERT_EQ(back.sizes(), figure.sizes());
  EXPECT_LE((back.to(torch::kFloat) / 255 - figure).abs().max().item<float>(), 0.5f / 255 + 1e-6f);

  viz::PerturbationFigureLayout plain;
  plain.zoom = 1;
  plain.captions = false;
  auto bare = viz::perturbation_figure(p, plain);
  EXPECT_EQ(bare.size(0), 16 * (28 + 2) + 2);
  EXPECT_EQ(bare.size(1), 11 * (28 + 2) + 2);
}

TEST(PerturbTest, CaptionGlyphsForOffsets) {
  auto canvas = torch::zeros({5, 12});
  viz::draw_text(canvas, 0, 0, "-+.");
  EXPECT_EQ(canvas.narrow(1, 0, 3).sum().item<float>(), 3.0f);  // '-': one row of 3
  EXPECT_EQ(canvas[2][1].item<float>(), 1.0f);
  EXPECT_EQ(canvas.narrow(1, 4, 3).sum().item<float>(), 5.0f);  // '+': 3 across, 2 more down the middle
  EXPECT_EQ(canvas[1][5].item<float>(), 1.0f);
  EXPECT_EQ(canvas.narrow(1, 8, 3).sum().item<float>(), 1.0f);  // '.': bottom middle
  EXPECT_EQ(canvas[4][9].item<float>(), 1.0f);
}

TEST(PerturbTest, BadInputGivesAClearError) {
  auto model = tiny_model();
  auto image = synthetic_image(12);
  expect_error_mentions([&] { viz::perturb_capsule(model, torch::rand({1, 13, 13})); }, "got [1, 13, 13]");
  expect_error_mentions([&] { viz::perturb_capsule(model, torch::rand({2, 12, 12})); }, "[1, 12, 12]");
  expect_error_mentions([&] { viz::perturb_capsule(model, (image * 255).to(torch::kUInt8)); }, "float");
  expect_error_mentions([&] { viz::perturb_capsule(model, image * 255); }, "[0, 1]");
  viz::PerturbationOptions options;
  options.capsule = 10;
  expect_error_mentions([&] { viz::perturb_capsule(model, image, options); }, "capsule 10 is out of range [0, 10)");
  options.capsule = -1;
  expect_error_mentions([&] { viz::perturb_capsule(model, image, options); }, "capsule -1");
  options.capsule.reset();
  options.offsets.clear();
  expect_error_mentions([&] { viz::perturb_capsule(model, image, options); }, "no offsets");
  auto no_decoder_config = testing::tiny_config();
  no_decoder_config.reconstruction = false;
  models::CapsNet no_decoder(no_decoder_config);
  expect_error_mentions([&] { viz::perturb_capsule(no_decoder, image); }, "no decoder");
  expect_error_mentions([] { viz::symmetric_offsets(0.0, 5); }, "must be positive, got 0");
  expect_error_mentions([] { viz::symmetric_offsets(0.25, 0); }, "steps must be >= 1, got 0");
}

/// `capsnet perturb` on a checkpoint trained for one step on a generated 28x28 IDX set.
class PerturbCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    data_ = *dir_ / "mnist";
    testing::write_fake_mnist(data_, 16, 32, 31, 32);
    train_ = run_command(kCli + " train --data " + data_ + " --out " + dir_->str() + "/run" +
                         " --steps 1 --batch-size 8 --no-eval --no-progress");
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string checkpoint() { return *dir_ / "run/checkpoint.pt"; }
  /// One thread: the work is tiny, and on a shared machine a second thread only waits for a busy core.
  static std::string perturb() { return kCli + " perturb --threads 1 "; }

  static inline const std::string kCli = CAPSNET_CLI;
  static inline TempDir* dir_ = nullptr;
  static inline std::string data_;
  static inline testing::CommandResult train_;
};

TEST_F(PerturbCliTest, DefaultRunWritesOneFigurePerClassAndTheJson) {
  ASSERT_EQ(train_.status, 0) << train_.output;
  const auto out = dir_->str() + "/perturb";
  auto r = run_command(perturb() + "--checkpoint " + checkpoint() + " --data " + data_ + " --out " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(out + "/perturb.json");
  ASSERT_TRUE(in) << r.output;
  const auto j = nlohmann::json::parse(in);
  ASSERT_EQ(j["offsets"].size(), 11u);
  EXPECT_NEAR(j["offsets"].front().get<double>(), -0.25, 1e-12);
  EXPECT_NEAR(j["offsets"].back().get<double>(), 0.25, 1e-12);
  ASSERT_EQ(j["digits"].size(), 10u);  // the generated test set has every class
  std::vector<bool> seen(10, false);
  for (const auto& d : j["digits"]) {
    const int64_t index = d["index"], label = d["label"], capsule = d["capsule"];
    EXPECT_EQ(label, index % 10);  // synthetic_set labels are index mod 10
    EXPECT_EQ(capsule, d["prediction"].get<int64_t>());
    seen[label] = true;
    EXPECT_EQ(d["png"], "perturb_" + std::to_string(index) + "_class" + std::to_string(capsule) + ".png");
    ASSERT_EQ(d["mean_abs_change"].size(), 16u);
    for (const auto& c : d["mean_abs_change"]) EXPECT_GE(c.get<double>(), 0.0);
    ASSERT_EQ(d["dimensions_by_change"].size(), 16u);
    auto png = viz::read_png_gray(out + "/" + d["png"].get<std::string>());
    EXPECT_EQ(png.size(0), 14 + 16 * 58 + 2);
    EXPECT_EQ(png.size(1), viz::text_width("15", 2) + 4 + 11 * 58 + 2);
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), true), 10);
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n') >= 11, true) << r.output;
  EXPECT_NE(r.output.find("most change: dims"), std::string::npos) << r.output;
}

TEST_F(PerturbCliTest, GivenIndicesUseTheLabelCapsule) {
  ASSERT_EQ(train_.status, 0) << train_.output;
  const auto out = dir_->str() + "/given";
  auto r = run_command(perturb() + "--checkpoint " + checkpoint() + " --data " + data_ + " --out " + out +
                       " --index 13 4 --use-label --zoom 1 --max-offset 0.5");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(std::ifstream(out + "/perturb.json"));
  ASSERT_EQ(j["digits"].size(), 2u);
  EXPECT_EQ(j["digits"][0]["index"], 13);
  EXPECT_EQ(j["digits"][0]["capsule"], 3);
  EXPECT_EQ(j["digits"][1]["capsule"], 4);
  EXPECT_EQ(j["capsule"], "label");
  EXPECT_NEAR(j["offsets"].front().get<double>(), -0.5, 1e-12);
  auto png = viz::read_png_gray(out + "/perturb_13_class3.png");
  EXPECT_EQ(png.size(0), 9 + 16 * 30 + 2);  // caption scale 1 below 40-px cells
  EXPECT_EQ(png.size(1), viz::text_width("15", 1) + 2 + 11 * 30 + 2);
  EXPECT_TRUE(std::filesystem::exists(out + "/perturb_4_class4.png"));
}

TEST_F(PerturbCliTest, BadInputGivesAClearErrorAndNonZeroStatus) {
  ASSERT_EQ(train_.status, 0) << train_.output;
  // A decoder-less checkpoint, saved directly: training one would only cost time.
  const auto no_decoder = dir_->str() + "/no_decoder.pt";
  {
    models::CapsNet model(narrow_mnist_config(false));
    train::CheckpointMeta meta;
    meta.model_config = model->config.to_json();
    train::save_checkpoint(no_decoder, model, nullptr, meta);
  }
  struct Case {
    std::string args, phrase;
  };
  const std::string base = " --data " + data_ + " --out " + dir_->str() + "/bad";
  const std::vector<Case> cases = {
      {"--checkpoint " + checkpoint() + " --index 32" + base, "--index 32 is out of range"},
      {"--checkpoint " + dir_->str() + "/missing.pt" + base, "missing.pt"},
      {"--checkpoint " + no_decoder + base, "this checkpoint has no decoder; train without --no-reconstruction"},
      {"--checkpoint " + checkpoint() + " --zoom 0" + base, "--zoom"},
  };
  for (const auto& c : cases) {
    auto r = run_command(perturb() + c.args);
    EXPECT_NE(r.status, 0) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.phrase), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir_->str() + "/bad/perturb.json"));
}

}  // namespace
}  // namespace capsnet
