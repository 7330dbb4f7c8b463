// bf16 compute (kernels/conv_dispatch.h): the layers against fp32 within bf16's rounding, gradients reach the
// fp32 master weights, one training step lowers the loss, and the option's errors. Weight files in
// fp16 / bf16 storage load back as the model that computed their probe.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>

#include "capsnet/models/baseline_cnn.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/export.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::TempDir;
using testing::tiny_config;

#define SKIP_WITHOUT_BF16() \
  if (!cpu_has_native_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16 / AMX"

double max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

TEST(Precision, ParsesNamesAndRefusesBadOnes) {
  EXPECT_EQ(parse_precision("fp32"), Precision::kFloat32);
  EXPECT_EQ(parse_precision("auto"), cpu_has_native_bf16() ? Precision::kBFloat16 : Precision::kFloat32);
  EXPECT_THROW(parse_precision("fp16"), std::invalid_argument);
  EXPECT_THROW(parse_precision(""), std::invalid_argument);
  if (cpu_has_native_bf16())
    EXPECT_EQ(parse_precision("bf16"), Precision::kBFloat16);
  else
    EXPECT_THROW(parse_precision("bf16"), std::invalid_argument);
  EXPECT_EQ(precision_name(Precision::kBFloat16), "bf16");
}

TEST(Precision, NumericPaddingReadsBothConvolutionKindsAndRefusesSymbolicPadding) {
  using torch::nn::Conv2dOptions;
  using torch::nn::ConvTranspose2dOptions;
  // The modules hold their options as detail::ConvNdOptions<2>, which is what numeric_padding reads.
  const auto p = kernels::numeric_padding(torch::nn::Conv2d(Conv2dOptions(3, 4, 5).padding({1, 2}))->options, "test");
  EXPECT_EQ(p->at(0), 1);
  EXPECT_EQ(p->at(1), 2);
  EXPECT_EQ(kernels::numeric_padding(torch::nn::ConvTranspose2d(ConvTranspose2dOptions(3, 4, 4).padding(1))->options, "test")
                ->at(1),
            1);
  for (const auto& bad : {Conv2dOptions(3, 4, 3).padding(torch::kSame),
                          Conv2dOptions(3, 4, 3).padding(1).padding_mode(torch::kReflect)}) {
    try {
      kernels::numeric_padding(torch::nn::Conv2d(bad)->options, "who_called");
      ADD_FAILURE() << "symbolic padding or a non-zero padding mode was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("who_called: only numeric zero padding"), std::string::npos) << e.what();
    }
  }
  // conv2d_at's bf16 path takes raw geometry, so a "same" convolution is refused there (fp32 runs it).
  torch::nn::Conv2d same(Conv2dOptions(2, 3, 3).padding(torch::kSame));
  EXPECT_EQ(kernels::conv2d_at(same, torch::rand({1, 2, 5, 5}), Precision::kFloat32).sizes(),
            (std::vector<int64_t>{1, 3, 5, 5}));
  EXPECT_THROW(kernels::conv2d_at(same, torch::rand({1, 2, 5, 5}), Precision::kBFloat16), c10::Error);
}

TEST(Precision, Bf16ConvAndLinearMatchFp32WithinBf16Rounding) {
  SKIP_WITHOUT_BF16();
  torch::manual_seed(0);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 16, 5).stride(2));
  torch::nn::Linear linear(64, 32);
  auto x = torch::rand({4, 3, 20, 20});
  auto y32 = kernels::conv2d_at(conv, x, Precision::kFloat32);
  auto y16 = kernels::conv2d_at(conv, x, Precision::kBFloat16);
  EXPECT_EQ(y16.scalar_type(), torch::kBFloat16);
  // bf16 keeps 8 significant bits (relative step 2^-8): inputs, weights and the output are rounded once each.
  EXPECT_LT(max_rel(y16.to(torch::kFloat32), y32), 3e-2);
  auto h = torch::randn({8, 64});
  EXPECT_LT(max_rel(kernels::linear_at(linear, h, Precision::kBFloat16).to(torch::kFloat32),
                    kernels::linear_at(linear, h, Precision::kFloat32)),
            3e-2);
}

TEST(Precision, Bf16ModelOutputsStayFp32AndCloseToFp32) {
  SKIP_WITHOUT_BF16();
  torch::manual_seed(1);
  models::CapsNet model(tiny_config());
  model->eval();
  auto x = torch::rand({8, 1, 12, 12});
  torch::NoGradGuard no_grad;
  auto a = model(x);
  model->set_precision(Precision::kBFloat16);
  auto b = model(x);
  EXPECT_EQ(b.lengths.scalar_type(), torch::kFloat32);
  EXPECT_EQ(b.reconstruction.scalar_type(), torch::kFloat32);
  EXPECT_LT((a.lengths - b.lengths).abs().max().item<double>(), 2e-2);
  EXPECT_LT((a.reconstruction - b.reconstruction).abs().max().item<double>(), 2e-2);
  for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
}

TEST(Precision, Bf16GradientsReachTheFp32WeightsAndAStepLowersTheLoss) {
  SKIP_WITHOUT_BF16();
  torch::manual_seed(2);
  models::CapsNet model(tiny_config());
  model->set_precision(Precision::kBFloat16);
  auto set = testing::synthetic_set(32, 12, 3);
  auto images = set.images.unsqueeze(1).to(torch::kFloat32) / 255;  // [32, 1, 12, 12]
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto loss_of = [&] { return model->loss(model(images, set.labels), images, set.labels).total; };
  const double before = loss_of().item<double>();
  for (int i = 0; i < 5; ++i) {
    adam.zero_grad();
    auto loss = loss_of();
    loss.backward();
    for (const auto& p : model->parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32);
    }
    adam.step();
  }
  EXPECT_LT(loss_of().item<double>(), before);
}

TEST(Precision, BaselineCnnInBf16StaysCloseToFp32AndAStepLowersTheLoss) {
  SKIP_WITHOUT_BF16();
  torch::manual_seed(3);
  models::BaselineCnnConfig c;
  c.image_size = 12, c.conv1_channels = 8, c.conv2_channels = 40, c.conv3_channels = 4;  // conv3: batch-swapped
  c.fc1_units = 16, c.fc2_units = 8, c.num_classes = 3;
  models::BaselineCnn model(c);
  model->eval();
  auto x = torch::rand({8, 1, 12, 12});
  torch::Tensor a, b;
  {
    torch::NoGradGuard no_grad;
    a = model(x);
    model->set_precision(Precision::kBFloat16);
    b = model(x);
  }
  EXPECT_EQ(b.scalar_type(), torch::kFloat32) << "logits come back in the input's dtype";
  // Six GEMM layers, each rounding its input, weights and output to 8 significant bits (2^-8 ~ 0.4%):
  // relative errors add up to a few percent of the logits' scale at most.
  EXPECT_LT(max_rel(b, a), 5e-2);

  model->train();
  auto labels = torch::tensor({0, 1, 2, 0, 1, 2, 0, 1}, torch::kLong);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  model->drop->options.p(0);  // the loss must be comparable between steps
  auto loss_of = [&] { return model->loss(model(x), labels); };
  const double before = loss_of().item<double>();
  for (int i = 0; i < 5; ++i) {
    adam.zero_grad();
    loss_of().backward();
    for (const auto& p : model->parameters()) EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32);
    adam.step();
  }
  EXPECT_LT(loss_of().item<double>(), before);
  for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
}

TEST(WeightStorage, HalfPrecisionFilesLoadAsTheModelThatWroteTheirProbe) {
  TempDir dir;
  for (auto storage : {train::WeightStorage::kFloat16, train::WeightStorage::kBFloat16}) {
    torch::manual_seed(4);
    models::CapsNet model(tiny_config());
    train::ExportOptions o;
    o.storage = storage;
    o.probe = 4;
    o.card = {{"dataset", "synthetic"}, {"test_accuracy", 0.5}};
    const auto path = dir / ("w_" + train::weight_storage_name(storage) + ".pt");
    train::save_weights(path, model, 3, o);
    auto w = train::read_weights(path);
    EXPECT_EQ(w.card["dataset"], "synthetic");
    EXPECT_EQ(w.state_dict.at("conv1.weight").scalar_type(),
              storage == train::WeightStorage::kFloat16 ? torch::kFloat16 : torch::kBFloat16);
    ASSERT_TRUE(train::is_weights_file(path));
    auto loaded = train::load_model(path);  // the same entry point as checkpoints
    for (const auto& p : loaded->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
    torch::NoGradGuard no_grad;
    auto out = loaded(w.probe.at("images"));
    // The probe was computed with the rounded weights: a loader computes exactly the same.
    EXPECT_TRUE(torch::allclose(out.lengths, w.probe.at("lengths"), 1e-6, 1e-6));
  }
}

TEST(WeightStorage, AMismatchedStateDictIsRefusedByName) {
  TempDir dir;
  torch::manual_seed(5);
  models::CapsNet model(tiny_config());
  // The tensors of an 8-channel conv1 under a config that claims 16 channels.
  auto d = train::export_dict(model, 1, {});
  auto config = model->config.to_json();
  config["conv1_channels"] = 16;
  d.insert_or_assign("config", config.dump());
  const auto bytes = torch::pickle_save(c10::IValue(d));
  const auto path = dir / "crafted.pt";
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  try {
    train::load_model(path);
    FAIL() << "a mismatched state dict loaded";
  } catch (const train::ExportError& e) {
    EXPECT_NE(std::string(e.what()).find("conv1.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  // A weight file is not a checkpoint to resume from.
  models::CapsNet m(tiny_config());
  train::save_weights(dir / "w.pt", model, 1);
  EXPECT_THROW(train::load_checkpoint(dir / "w.pt", m, nullptr), train::CheckpointError);
  EXPECT_FALSE(train::is_weights_file(dir / "missing.pt"));
}

}  // namespace
}  // namespace capsnet
