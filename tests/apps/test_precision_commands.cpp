// --precision on em, segcaps, capspix2pix and ablation (issue 17): for the matrix-capsule network, SegCaps
// and the conditional GAN, bf16 convolutions against fp32 with the same weights (within bf16's rounding),
// fp32 master weights and gradients, one bf16 training step lowering a fixed batch's loss, and a
// checkpoint written by a bf16 run loading into an fp32 model; then the four commands' flag.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "capsnet/data/label_maps.h"
#include "capsnet/data/segmentation.h"
#include "capsnet/models/capspix2pix.h"
#include "capsnet/models/matrix_capsnet.h"
#include "capsnet/models/segcaps.h"
#include "capsnet/nn/em_routing.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "apps/experiments/capspix2pix.h"
#include "capsnet/train/checkpoint.h"
#include "apps/experiments/em.h"
#include "apps/experiments/segcaps.h"
#include "gradcheck.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace capsnet {
namespace {

using testing::TempDir;
using testing::ScopedThreads;

#define SKIP_WITHOUT_BF16() \
  if (!cpu_has_native_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16 / AMX"

// The tolerance of a bf16 forward pass against fp32, from bf16's 8 significant bits: rounding to the
// nearest bf16 errs by at most half a step, 2^-9 of the value. A bf16 convolution rounds its input, its
// weights and its output once each, so its output is off by about 3 * 2^-9 of its scale (the products'
// rounding errors are independent: over a sum they grow like sqrt(n), as the sum itself does). Between
// the convolutions the layers here (ReLU, squash, sigmoid, tanh, BatchNorm of well-spread channels,
// routing's weighted means) pass relative errors on without enlarging them to first order, so a path
// through L convolutions in series is allowed L * 3 * 2^-9 of the largest fp32 output.
constexpr double kBf16HalfStep = 1.0 / 512;  // 2^-9
double bf16_tolerance(int convolutions_in_series) { return convolutions_in_series * 3 * kBf16HalfStep; }

// max |bf16 - fp32| relative to max |fp32| is within bf16_tolerance(depth); the measured value is kept
// as a test property (--gtest_output=xml shows it).
void expect_close(const torch::Tensor& bf16_run, const torch::Tensor& fp32_run, int depth, const std::string& what) {
  ASSERT_EQ(bf16_run.sizes(), fp32_run.sizes()) << what;
  const double error = ((bf16_run - fp32_run).abs().max() / fp32_run.abs().max().clamp_min(1e-12)).item<double>();
  ::testing::Test::RecordProperty(what, std::to_string(error));
  EXPECT_LE(error, bf16_tolerance(depth)) << what;
}

void expect_fp32_parameters_with_fp32_gradients(torch::nn::Module& model) {
  for (const auto& item : model.named_parameters()) {
    EXPECT_EQ(item.value().scalar_type(), torch::kFloat32) << item.key();
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_EQ(item.value().grad().scalar_type(), torch::kFloat32) << item.key();
    EXPECT_TRUE(torch::isfinite(item.value().grad()).all().item<bool>()) << item.key();
  }
}

// One Adam step of a bf16 model at learning rate `lr`: the loss `loss_of()` is fp32, every parameter and
// gradient is fp32 and finite, and the loss is lower after the step.
void expect_bf16_step_lowers_the_loss(torch::nn::Module& model, const std::function<torch::Tensor()>& loss_of,
                                      double lr) {
  torch::optim::Adam adam(model.parameters(), torch::optim::AdamOptions(lr));
  auto loss = loss_of();
  EXPECT_EQ(loss.scalar_type(), torch::kFloat32);
  const double before = loss.item<double>();
  adam.zero_grad();
  loss.backward();
  expect_fp32_parameters_with_fp32_gradients(model);
  adam.step();
  torch::NoGradGuard no_grad;
  EXPECT_LT(loss_of().item<double>(), before);
}

// Every parameter of `loaded` is fp32 and equal to the same-named one of `trained`.
void expect_equal_fp32_weights(torch::nn::Module& loaded, torch::nn::Module& trained) {
  const auto want = trained.named_parameters();
  const auto got = loaded.named_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& item : got) {
    EXPECT_EQ(item.value().scalar_type(), torch::kFloat32) << item.key();
    EXPECT_TRUE(torch::equal(item.value(), want[item.key()])) << item.key();
  }
}

// The "train" options of a run's first metrics record (the loop's "start" event).
nlohmann::json start_options(const std::string& out_dir) {
  std::ifstream in(train::metrics_path(out_dir));
  std::string line;
  std::getline(in, line);
  const auto start = nlohmann::json::parse(line);
  EXPECT_EQ(start.at("event"), "start");
  return start.at("train");
}

// ---- the bf16 transposed convolution (GEMM + overlap-add) ------------------------------------------

TEST(ConvTranspose2dAt, Bf16MatchesATensTransposedConvolutionInValuesAndGradients) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  struct Case {
    int64_t groups, in_per_group, out_per_group, k0, k1, stride, padding, output_padding;
  };
  // SegCaps' and the U-net's 4x4/2 (padding 1), grouped ones, a non-square kernel, output padding.
  for (const auto& c : std::vector<Case>{{1, 6, 5, 4, 4, 2, 1, 0}, {3, 4, 6, 4, 4, 2, 1, 0}, {2, 3, 4, 3, 2, 1, 0, 0},
                                          {2, 5, 3, 3, 3, 2, 1, 1}}) {
    const std::string tag = "groups" + std::to_string(c.groups) + "_k" + std::to_string(c.k0) + "x" +
                            std::to_string(c.k1) + "_s" + std::to_string(c.stride) + "_op" +
                            std::to_string(c.output_padding);
    SCOPED_TRACE(tag);
    torch::manual_seed(11);
    auto x = torch::randn({3, c.groups * c.in_per_group, 5, 6}).requires_grad_();
    auto w = torch::randn({c.groups * c.in_per_group, c.out_per_group, c.k0, c.k1}).requires_grad_();
    auto b = torch::randn({c.groups * c.out_per_group}).requires_grad_();
    auto probe = torch::randn_like(torch::conv_transpose2d(x, w, b, c.stride, c.padding, c.output_padding, c.groups));
    std::vector<torch::Tensor> outs;
    for (auto precision : {Precision::kFloat32, Precision::kBFloat16}) {
      auto y = kernels::conv_transpose2d_at(x, w, b, c.stride, c.padding, c.output_padding, c.groups, precision);
      EXPECT_EQ(y.scalar_type(), torch::kFloat32);
      auto grads = torch::autograd::grad({(y * probe).sum()}, {x, w, b});
      outs.insert(outs.end(), {y.detach(), grads[0], grads[1], grads[2]});
    }
    // fp32 is ATen's own. One GEMM in bf16 (forward) or two (backward): each rounds its operands and
    // its result once. The bias gradient does not pass through bf16 at all.
    expect_close(outs[4], outs[0], 1, tag + "_value");
    expect_close(outs[5], outs[1], 1, tag + "_grad_x");
    expect_close(outs[6], outs[2], 1, tag + "_grad_weight");
    EXPECT_TRUE(torch::allclose(outs[7], outs[3], 1e-5, 1e-5));
    EXPECT_EQ(outs[6].scalar_type(), torch::kFloat32);
  }
}

// ---- matrix capsules (EM routing) ----------------------------------------------------------------

// Small, but with the default 32 Conv1 channels: PrimaryCaps' convolutions have conv2d_at's "many input
// channels" (kBatchSwappedMinInChannels).
models::MatrixCapsNetConfig em_config() {
  auto c = testing::tiny_em_config(32);
  c.routing_iterations = 2;
  return c;
}

TEST(EmPrecision, Bf16ForwardIsCloseToFp32WithTheSameWeights) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  torch::manual_seed(1);
  models::MatrixCapsNet model(em_config());
  auto images = experiments::to_input(testing::synthetic_set(6, 28, 2).images);  // [6, 1, 28, 28]
  torch::NoGradGuard no_grad;
  auto a = model->forward(images);
  model->set_precision(Precision::kBFloat16);
  auto b = model->forward(images);
  EXPECT_EQ(b.activations.scalar_type(), torch::kFloat32);
  EXPECT_EQ(b.poses.scalar_type(), torch::kFloat32);
  // Conv1 -> PrimaryCaps: two convolutions in series; votes and routing are fp32.
  expect_close(b.activations, a.activations, 2, "activations");
  expect_close(b.poses, a.poses, 2, "poses");
  EXPECT_FALSE(torch::equal(b.poses, a.poses));  // the convolutions did run in bf16
}

TEST(EmPrecision, Bf16StepKeepsFp32WeightsAndGradientsAndLowersTheLoss) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  torch::manual_seed(3);
  models::MatrixCapsNet model(em_config());
  model->set_precision(Precision::kBFloat16);
  auto set = testing::synthetic_set(10, 28, 21);
  auto images = experiments::to_input(set.images);
  expect_bf16_step_lowers_the_loss(
      *model, [&] { return spread_loss(model->forward(images).activations, set.labels, 0.5); }, 1e-3);
}

TEST(EmPrecision, CheckpointOfABf16RunLoadsIntoAnFp32Model) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  TempDir dir;
  auto set = testing::synthetic_set(16, 28, 5);
  experiments::EmTrainOptions o;
  o.model = em_config();
  o.loop.out_dir = dir / "run";
  o.loop.max_steps = 2;
  o.loop.batch_size = 8;
  o.test_size = 0;
  o.loop.log_every = 1;
  o.loop.progress = false;
  o.loop.precision = Precision::kBFloat16;
  std::ostringstream log;
  auto r = experiments::train_em(o, set, nullptr, log);
  EXPECT_EQ(r.model->precision(), Precision::kBFloat16);
  EXPECT_EQ(start_options(o.loop.out_dir).at("precision"), "bf16");
  EXPECT_NE(log.str().find("bf16 compute"), std::string::npos) << log.str();
  torch::manual_seed(99);  // other initial weights: the load must replace them all
  models::MatrixCapsNet fp32(o.model);
  train::load_checkpoint(r.checkpoint, *fp32, nullptr, [&](const nlohmann::json& saved) {
    return models::MatrixCapsNetConfig::from_json(saved).to_json() == o.model.to_json();
  });
  EXPECT_EQ(fp32->precision(), Precision::kFloat32);
  expect_equal_fp32_weights(*fp32, *r.model);
}

// ---- SegCaps -------------------------------------------------------------------------------------

models::SegCapsConfig segcaps_config(int64_t image_size = 12) {
  // recon_weight 0.5: the decoder's 1x1 convolutions too (the paper's 64 and 128 channels).
  return testing::tiny_segcaps_config(image_size, 0.5);
}

TEST(SegCapsPrecision, Bf16ForwardIsCloseToFp32WithTheSameWeights) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  torch::manual_seed(6);
  models::SegCaps model(segcaps_config());
  auto images = torch::rand({3, 1, 12, 12});
  auto masks = (images > 0.6).to(torch::kFloat);
  torch::NoGradGuard no_grad;
  auto a = model->forward(images, masks);
  model->set_precision(Precision::kBFloat16);
  auto b = model->forward(images, masks);
  EXPECT_EQ(b.probability.scalar_type(), torch::kFloat32);
  EXPECT_EQ(b.reconstruction.scalar_type(), torch::kFloat32);
  // The longest path: stem, primary, down1, down2, bottom, up1, up1_conv, up2, seg = 9 convolutions;
  // the reconstruction adds the decoder's 3.
  expect_close(b.probability, a.probability, 9, "probability");
  expect_close(b.reconstruction, a.reconstruction, 12, "reconstruction");
  EXPECT_FALSE(torch::equal(b.probability, a.probability));
}

TEST(SegCapsPrecision, Bf16StepKeepsFp32WeightsAndGradientsAndLowersTheLoss) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  torch::manual_seed(7);
  models::SegCaps model(segcaps_config());
  model->set_precision(Precision::kBFloat16);
  auto images = torch::rand({3, 1, 12, 12});
  auto masks = (images > 0.6).to(torch::kFloat);
  expect_bf16_step_lowers_the_loss(*model, [&] { return model->loss(model->forward(images, masks), masks, images); },
                                   1e-2);
}

TEST(SegCapsPrecision, CheckpointOfABf16RunLoadsIntoAnFp32Model) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  TempDir dir;
  data::DigitSegmentationOptions d;
  d.canvas = 28;
  data::DigitSegmentation train_set(testing::synthetic_set(20, 28, 1), 1, d), test_set(testing::synthetic_set(8, 28, 2), 2, d);
  experiments::SegCapsTrainOptions o;
  o.model = segcaps_config(28);
  o.loop.out_dir = dir / "run";
  o.loop.max_steps = 2;
  o.loop.batch_size = 2;
  o.test_size = 2;
  o.eval_batch_size = 2;
  o.loop.log_every = 1;
  o.loop.progress = false;
  o.loop.precision = Precision::kBFloat16;
  std::ostringstream log;
  auto r = experiments::train_segcaps(o, train_set, test_set, log);
  EXPECT_EQ(r.model->precision(), Precision::kBFloat16);
  EXPECT_EQ(start_options(o.loop.out_dir).at("precision"), "bf16");
  torch::manual_seed(99);
  models::SegCaps fp32(o.model);
  train::load_checkpoint(train::checkpoint_path(o.loop.out_dir), *fp32, nullptr, [&](const nlohmann::json& saved) {
    return models::SegCapsConfig::from_json(saved).to_json() == o.model.to_json();
  });
  EXPECT_EQ(fp32->precision(), Precision::kFloat32);
  expect_equal_fp32_weights(*fp32, *r.model);
}

// ---- CapsPix2pix / pix2pix -----------------------------------------------------------------------

// Small, S = 16, but 32 discriminator and 16 CNN channels: D's second and third and the U-net's third
// and fourth convolutions have conv2d_at's "many input channels" (kBatchSwappedMinInChannels).
models::Pix2pixConfig pix2pix_config(const std::string& generator) {
  return testing::tiny_pix2pix_config(generator, /*cnn_channels=*/16, /*disc_channels=*/32);
}

data::LabelMapOptions maps16() {
  data::LabelMapOptions o;
  o.size = 16;
  return o;
}

TEST(Pix2pixPrecision, Bf16ForwardIsCloseToFp32WithTheSameWeights) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  // Generators: caps = stem, 7 capsule layers, to_image (9 in series); cnn = 4 down + 4 up. The
  // discriminator: 3 in series.
  for (const auto& [generator, depth] : std::vector<std::pair<std::string, int>>{{"caps", 9}, {"cnn", 8}}) {
    SCOPED_TRACE(generator);
    torch::manual_seed(4);
    models::Pix2pix model(pix2pix_config(generator));
    data::LabelMaps set(testing::synthetic_set(10, 28, 1), 2, maps16());
    auto b = set.generate(0, 8);
    auto z = torch::randn({8, 2});
    torch::NoGradGuard no_grad;
    auto fake32 = model->generate(b.one_hot, z);
    auto logits32 = model->discriminator->forward(b.one_hot, b.images);
    model->set_precision(Precision::kBFloat16);
    auto fake16 = model->generate(b.one_hot, z);
    auto logits16 = model->discriminator->forward(b.one_hot, b.images);
    EXPECT_EQ(fake16.scalar_type(), torch::kFloat32);
    EXPECT_EQ(logits16.scalar_type(), torch::kFloat32);
    expect_close(fake16, fake32, depth, generator + "_image");
    expect_close(logits16, logits32, 3, generator + "_discriminator_logits");
    EXPECT_FALSE(torch::equal(fake16, fake32));
  }
}

TEST(Pix2pixPrecision, Bf16StepKeepsFp32WeightsAndGradientsAndLowersTheL1) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  for (const std::string generator : {"caps", "cnn"}) {
    SCOPED_TRACE(generator);
    torch::manual_seed(5);
    models::Pix2pix model(pix2pix_config(generator));
    model->set_precision(Precision::kBFloat16);
    data::LabelMaps set(testing::synthetic_set(10, 28, 1), 2, maps16());
    auto b = set.generate(0, 8);
    auto z = torch::randn({8, 2});
    {  // Both networks' gradients (D's loss and G's, which reaches G through D).
      auto fake = model->generate(b.one_hot, z);
      auto l = model->generator_losses(b.one_hot, b.images, fake);
      EXPECT_EQ(l.generator.scalar_type(), torch::kFloat32);
      (model->discriminator_loss(b.one_hot, b.images, fake) + l.generator).backward();
      expect_fp32_parameters_with_fp32_gradients(*model);
    }
    // One step of the GAN (D, then G): its L1 to the real images, the generator's objective that is
    // not adversarial, goes down on the batch it saw.
    auto opt = experiments::make_pix2pix_optimizer(model, 2e-4, 0.5);
    auto l1 = [&] {
      torch::NoGradGuard no_grad;
      return (model->generate(b.one_hot, z) - b.images).abs().mean().item<double>();
    };
    const double before = l1();
    experiments::pix2pix_step(model, *opt, b.one_hot, b.images, z);
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
    EXPECT_LT(l1(), before);
  }
}

TEST(Pix2pixPrecision, CheckpointOfABf16RunLoadsIntoAnFp32Model) {
  SKIP_WITHOUT_BF16();
  ScopedThreads one(1);
  TempDir dir;
  data::LabelMaps train_set(testing::synthetic_set(10, 28, 1), 2, maps16()),
      test_set(testing::synthetic_set(10, 28, 3), 3, maps16());
  experiments::Pix2pixTrainOptions o;
  o.model = pix2pix_config("caps");
  o.loop.out_dir = dir / "run";  // the experiment's own loop defaults otherwise
  o.loop.precision = Precision::kBFloat16;
  o.loop.max_steps = 2;
  o.loop.batch_size = 2;
  o.loop.log_every = 1;
  o.loop.progress = false;
  o.test_size = 2;
  o.eval_batch_size = 2;
  o.diversity_maps = 1;
  o.diversity_samples = 2;
  std::ostringstream log;
  auto r = experiments::train_pix2pix(o, train_set, test_set, log);
  EXPECT_EQ(r.model->precision(), Precision::kBFloat16);
  EXPECT_EQ(start_options(o.loop.out_dir).at("precision"), "bf16");
  auto fp32 = experiments::load_pix2pix(train::checkpoint_path(o.loop.out_dir));  // built with fp32, as any loader is
  EXPECT_EQ(fp32->precision(), Precision::kFloat32);
  expect_equal_fp32_weights(*fp32, *r.model);
  // clone() rebuilds the networks: they keep the pair's precision.
  auto copy = std::dynamic_pointer_cast<models::Pix2pixImpl>(r.model->clone());
  ASSERT_TRUE(copy);
  torch::NoGradGuard no_grad;
  auto b = test_set.generate(0, 2);
  auto z = torch::randn({2, 2});
  EXPECT_TRUE(torch::equal(copy->generate(b.one_hot, z), r.model->generate(b.one_hot, z)));
}

// ---- the commands' flag --------------------------------------------------------------------------

const std::string kCli = CAPSNET_CLI;

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

TEST(PrecisionCommandsCli, EmSegcapsCapspix2pixAndAblationTakeFp32AndRefuseFp16) {
  TempDir dir;
  const std::string data = dir / "mnist";
  testing::write_fake_mnist(data, 32, 16);
  struct Command {
    std::string name, args, summary;  // summary: the command's own JSON file in --out
  };
  const std::vector<Command> commands = {
      {"em",
       " --steps 1 --batch-size 4 --test-size 4 --conv1-channels 4 --primary-types 2 --caps1-types 2"
       " --caps2-types 2 --routing-iters 1",
       "em.json"},
      {"segcaps",
       " --steps 1 --batch-size 2 --test-size 2 --canvas 28 --types 2 --stem-channels 4 --figure-rows 0",
       "segcaps.json"},
      {"capspix2pix", " --generator cnn --steps 1 --batch-size 2 --test-size 2 --figure-rows 0", "capspix2pix.json"},
      {"ablation", " --routing 1 --reconstruction off --steps 1 --batch-size 8 --test-limit 8", "ablation.json"},
  };
  for (const auto& c : commands) {
    SCOPED_TRACE(c.name);
    const std::string out = dir / c.name;
    auto r = testing::run_command(kCli + " " + c.name + " --data " + data + " --out " + out + c.args +
                                  " --precision fp32 --no-progress --threads 1");
    ASSERT_EQ(r.status, 0) << r.output;
    // Recorded where the run's options are: the loop's start record, and the command's summary.
    const std::string run_dir = c.name == "ablation" ? out + "/r1_norecon" : out;
    EXPECT_EQ(start_options(run_dir).at("precision"), "fp32");
    const auto summary = read_json(out + "/" + c.summary);
    const auto recorded = c.name == "em"         ? summary.at("train").at("precision")
                          : c.name == "ablation" ? summary.at(0).at("precision")
                                                 : summary.at("precision");
    EXPECT_EQ(recorded, "fp32") << summary.dump();

    auto bad = testing::run_command(kCli + " " + c.name + " --data " + data + " --out " + (dir / "bad") +
                                    " --precision fp16");
    EXPECT_NE(bad.status, 0) << bad.output;
    EXPECT_NE(bad.output.find("--precision"), std::string::npos) << bad.output;
    EXPECT_NE(bad.output.find("fp16"), std::string::npos) << bad.output;
    EXPECT_FALSE(std::filesystem::exists(dir / "bad")) << "refused before any work";
  }

  // The ablation's reuse check sees the precision: its fp32 run is not taken for a bf16 one ...
  const std::string ablation = kCli + " ablation --data " + data + " --out " + (dir / "ablation") +
                               commands.back().args + " --no-progress --threads 1";
  if (cpu_has_native_bf16()) {
    auto other = testing::run_command(ablation + " --precision bf16");
    EXPECT_NE(other.status, 0) << other.output;
    EXPECT_NE(other.output.find("other settings"), std::string::npos) << other.output;
    EXPECT_NE(other.output.find("\"precision\":\"fp32\""), std::string::npos) << other.output;
  }
  // ... and a run recorded before the flag (no precision key) was fp32: reused under fp32.
  for (const std::string file : {"result.json", "settings.json"}) {
    const std::string path = dir / ("ablation/r1_norecon/" + file);
    auto j = read_json(path);
    j.at("settings").erase("precision");
    j.erase("precision");
    std::ofstream(path) << j.dump(2);
  }
  auto again = testing::run_command(ablation + " --precision fp32");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("reusing"), std::string::npos) << again.output;
  EXPECT_EQ(read_json(dir / "ablation/ablation.json").at(0).at("precision"), "fp32");
}

}  // namespace
}  // namespace capsnet
