// The MNIST CapsNet (capsnet/models/capsnet.h): parameter counts, shapes, masking, loss,
// config JSON, a few optimisation steps, and an end-to-end float64 gradient check.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "capsnet/models/capsnet.h"
#include "gradcheck.h"
#include "test_helpers.h"

namespace {

using capsnet::models::CapsNet;
using capsnet::models::CapsNetConfig;
using capsnet::models::CapsNetOutput;
using capsnet::models::count_parameters;

// 12x12 -> conv1 3x3 -> 10x10 -> primary 3x3/2 -> 4x4 x 4 types = 64 capsules of 8D, digit capsules of 16D.
CapsNetConfig small_config() {
  CapsNetConfig c = capsnet::testing::tiny_config();
  c.primary_dim = 8;
  c.digit_dim = 16;
  return c;
}

TEST(CapsNetModelTest, PaperConfigParameterCounts) {
  CapsNetConfig c;
  EXPECT_EQ(c.primary_grid(), 6);
  EXPECT_EQ(c.num_primary_caps(), 1152);
  EXPECT_NO_THROW(c.validate());
  torch::manual_seed(20);
  CapsNet model(c);
  // conv1 256*81+256 + primary 256*256*81+256 + W 1152*10*16*8
  //   + decoder (160*512+512) + (512*1024+1024) + (1024*784+784)
  EXPECT_EQ(count_parameters(*model), 8215568);
  EXPECT_EQ(count_parameters(*model->digit_caps), 1474560);
  c.reconstruction = false;
  CapsNet no_decoder(c);
  EXPECT_EQ(count_parameters(*no_decoder), 6804224);
  EXPECT_TRUE(no_decoder->decoder.is_empty());
}

TEST(CapsNetModelTest, ForwardShapesPaperConfig) {
  torch::manual_seed(21);
  CapsNet model;
  auto images = torch::rand({2, 1, 28, 28});
  auto out = model->forward(images);
  EXPECT_EQ(out.digit_caps.sizes(), (std::vector<int64_t>{2, 10, 16}));
  EXPECT_EQ(out.lengths.sizes(), (std::vector<int64_t>{2, 10}));
  ASSERT_TRUE(out.reconstruction.defined());
  EXPECT_EQ(out.reconstruction.sizes(), (std::vector<int64_t>{2, 784}));
  EXPECT_GT(out.reconstruction.min().item<float>(), 0.0f);
  EXPECT_LT(out.reconstruction.max().item<float>(), 1.0f);
  EXPECT_LT(out.lengths.max().item<float>(), 1.0f);
  EXPECT_TRUE(torch::allclose(out.lengths, capsnet::capsule_length(out.digit_caps)));
  // Wrong image sizes are refused.
  EXPECT_THROW(model->forward(torch::rand({2, 1, 27, 28})), c10::Error);
  EXPECT_THROW(model->forward(torch::rand({2, 3, 28, 28})), c10::Error);
  EXPECT_THROW(model->forward(torch::rand({1, 28, 28})), c10::Error);
}

TEST(CapsNetModelTest, ForwardIsTheLayerComposition) {
  // v = DigitCaps(PrimaryCaps(ReLU(Conv1(x)))), lengths |v|, reconstruction from the masked capsules.
  torch::manual_seed(27);
  CapsNet model(small_config());
  auto images = torch::rand({3, 1, 12, 12});
  auto labels = torch::tensor({4, 4, 1}, torch::kLong);
  auto out = model->forward(images, labels);
  auto v = model->digit_caps(model->primary_caps(torch::relu(model->conv1(images))));
  EXPECT_TRUE(torch::allclose(out.digit_caps, v, 1e-5, 1e-7));
  EXPECT_TRUE(torch::allclose(out.lengths, capsnet::capsule_length(v), 1e-5, 1e-7));
  EXPECT_TRUE(torch::allclose(out.reconstruction, model->decoder(capsnet::mask(v, labels)), 1e-5, 1e-6));
  EXPECT_EQ(model->primary_caps(torch::relu(model->conv1(images))).sizes(), (std::vector<int64_t>{3, 64, 8}));
  EXPECT_EQ(small_config().num_primary_caps(), 64);
}

TEST(CapsNetModelTest, AuthorsInitialisation) {
  // init "authors": truncated normals (|w| <= 2 sigma; std 0.8796 sigma), biases 0.1, and PrimaryCaps'
  // convolution divided by the number of types, its bias 0.1 after the division.
  torch::manual_seed(28);
  auto c = small_config();
  c.conv1_channels = 64;
  c.init = "authors";
  EXPECT_DOUBLE_EQ(c.primary_scale(), 1.0 / c.primary_types);
  CapsNet model(c);
  auto truncated = [](const torch::Tensor& w, double sigma, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_LE(w.abs().max().item<double>(), 2 * sigma * (1 + 1e-6));
    const double sd = w.std().item<double>(), expected = 0.8796 * sigma;
    EXPECT_NEAR(sd, expected, 4 * expected / std::sqrt(double(w.numel())) + 0.01 * expected);
    EXPECT_NEAR(w.mean().item<double>(), 0.0, 4 * expected / std::sqrt(double(w.numel())));
  };
  truncated(model->conv1->weight, 0.05, "conv1");
  truncated(model->primary_caps->conv->weight, 0.1, "primary");
  truncated(model->digit_caps->weight, 0.1, "digit");
  for (auto* fc : {&model->decoder->fc1, &model->decoder->fc2, &model->decoder->fc3}) {
    truncated((*fc)->weight, 0.1, "decoder");
    EXPECT_TRUE(torch::all((*fc)->bias == 0.1f).item<bool>());
  }
  EXPECT_TRUE(torch::all(model->conv1->bias == 0.1f).item<bool>());
  EXPECT_TRUE(torch::allclose(model->primary_caps->conv->bias * c.primary_scale(),
                              torch::full({c.primary_types * c.primary_dim}, 0.1f)));
  // The forward divides PrimaryCaps' convolution: u = squash(regroup(conv(relu(conv1 x)) / types)).
  auto images = torch::rand({3, 1, 12, 12});
  auto y = model->primary_caps->conv(torch::relu(model->conv1(images))) / double(c.primary_types);  // [3, 32, 4, 4]
  auto u = capsnet::squash(y.view({3, c.primary_types, 8, 4, 4}).permute({0, 1, 3, 4, 2}).reshape({3, -1, 8}));
  EXPECT_TRUE(torch::allclose(model->digit_caps(u), model->forward(images).digit_caps, 1e-5, 1e-7));
  // Seeded: the same weights again; the default init is untouched by the option.
  torch::manual_seed(28);
  CapsNet again(c);
  EXPECT_TRUE(torch::equal(again->digit_caps->weight, model->digit_caps->weight));
  c.init = "torch";
  EXPECT_DOUBLE_EQ(c.primary_scale(), 1.0);
  torch::manual_seed(28);
  CapsNet plain(c);
  EXPECT_LT(plain->digit_caps->weight.std().item<double>(), 0.02);
  EXPECT_EQ(plain->primary_caps->options.output_scale(), 1.0);
}

TEST(CapsNetModelTest, ForwardWithoutDecoder) {
  auto c = small_config();
  c.reconstruction = false;
  torch::manual_seed(22);
  CapsNet model(c);
  auto images = torch::rand({3, 1, 12, 12});
  auto labels = torch::tensor({1, 2, 3}, torch::kLong);
  auto out = model->forward(images, labels);
  EXPECT_FALSE(out.reconstruction.defined());
  EXPECT_EQ(out.digit_caps.sizes(), (std::vector<int64_t>{3, 10, 16}));
  EXPECT_THROW(model->decode(out.digit_caps, labels), c10::Error);
  auto l = model->loss(out, images, labels);
  EXPECT_EQ(l.reconstruction.item<float>(), 0.0f);
  EXPECT_EQ(l.total.item<float>(), l.margin.item<float>());
}

TEST(CapsNetModelTest, ReconstructionUsesLabelOrLongestCapsule) {
  torch::manual_seed(23);
  CapsNet model(small_config());
  {
    torch::NoGradGuard g;
    model->digit_caps->weight.mul_(30);  // capsules long enough that they differ visibly
  }
  auto images = torch::rand({4, 1, 12, 12});
  auto plain = model->forward(images);
  auto predicted = plain.lengths.argmax(1);
  auto other = (predicted + 1) % 10;  // never the argmax
  auto with_labels = model->forward(images, other);
  // Same capsules either way; the decoder input differs.
  EXPECT_TRUE(torch::allclose(with_labels.digit_caps, plain.digit_caps));
  EXPECT_TRUE(torch::allclose(plain.reconstruction, model->decode(plain.digit_caps, predicted), 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(with_labels.reconstruction, model->decode(plain.digit_caps, other), 1e-6, 1e-7));
  EXPECT_GT((with_labels.reconstruction - plain.reconstruction).abs().max().item<float>(), 1e-4);
  // decode() is decoder(mask(v, which)).
  EXPECT_TRUE(torch::allclose(model->decode(plain.digit_caps, other),
                              model->decoder(capsnet::mask(plain.digit_caps, other)), 1e-6, 1e-7));
}

TEST(CapsNetModelTest, LossIsMarginPlusScaledSse) {
  torch::manual_seed(24);
  auto c = small_config();
  CapsNet model(c);
  auto images = torch::rand({5, 1, 12, 12});
  auto labels = torch::tensor({0, 3, 9, 3, 5}, torch::kLong);
  auto out = model->forward(images, labels);
  auto l = model->loss(out, images, labels);
  // Margin loss written out: T max(0, 0.9 - |v|)^2 + 0.5 (1 - T) max(0, |v| - 0.1)^2, sum_k, mean_b.
  auto T = torch::one_hot(labels, 10).to(torch::kFloat);
  auto L = out.lengths;
  auto margin = (T * torch::clamp_min(0.9 - L, 0).pow(2) + 0.5 * (1 - T) * torch::clamp_min(L - 0.1, 0).pow(2))
                    .sum(1)
                    .mean();
  auto sse = (out.reconstruction - images.view({5, 144})).pow(2).sum(1).mean();
  EXPECT_NEAR(l.margin.item<float>(), margin.item<float>(), 1e-6);
  EXPECT_NEAR(l.reconstruction.item<float>(), 0.0005f * sse.item<float>(), 1e-7);
  EXPECT_NEAR(l.total.item<float>(), margin.item<float>() + 0.0005f * sse.item<float>(), 1e-6);
  EXPECT_GT(l.reconstruction.item<float>(), 0.0f);
  // The scale comes from the config.
  model->config.reconstruction_scale = 0.01;
  auto l2 = model->loss(out, images, labels);
  EXPECT_NEAR(l2.reconstruction.item<float>(), 0.01f * sse.item<float>(), 1e-6);
  EXPECT_NEAR(l2.margin.item<float>(), margin.item<float>(), 1e-6);
}

CapsNetConfig non_default_config() {
  CapsNetConfig c;
  c.image_channels = 3;
  c.image_size = 40;
  c.conv1_channels = 128;
  c.conv1_kernel = 7;
  c.primary_types = 16;
  c.primary_dim = 4;
  c.primary_kernel = 5;
  c.primary_stride = 3;
  c.num_classes = 11;
  c.digit_dim = 12;
  c.routing_iterations = 5;
  c.grad_through_routing = false;
  c.reconstruction = false;
  c.reconstruction_scale = 0.125;
  c.init = "authors";
  return c;
}

void expect_same_config(const CapsNetConfig& a, const CapsNetConfig& b) {
  EXPECT_EQ(a.image_channels, b.image_channels);
  EXPECT_EQ(a.image_size, b.image_size);
  EXPECT_EQ(a.conv1_channels, b.conv1_channels);
  EXPECT_EQ(a.conv1_kernel, b.conv1_kernel);
  EXPECT_EQ(a.primary_types, b.primary_types);
  EXPECT_EQ(a.primary_dim, b.primary_dim);
  EXPECT_EQ(a.primary_kernel, b.primary_kernel);
  EXPECT_EQ(a.primary_stride, b.primary_stride);
  EXPECT_EQ(a.num_classes, b.num_classes);
  EXPECT_EQ(a.digit_dim, b.digit_dim);
  EXPECT_EQ(a.routing_iterations, b.routing_iterations);
  EXPECT_EQ(a.grad_through_routing, b.grad_through_routing);
  EXPECT_EQ(a.reconstruction, b.reconstruction);
  EXPECT_EQ(a.reconstruction_scale, b.reconstruction_scale);
  EXPECT_EQ(a.init, b.init);
}

TEST(CapsNetModelTest, ConfigJsonRoundTrip) {
  const auto c = non_default_config();
  EXPECT_NO_THROW(c.validate());
  const auto j = c.to_json();
  EXPECT_EQ(j.at("image_size").get<int64_t>(), 40);
  EXPECT_EQ(j.at("grad_through_routing").get<bool>(), false);
  expect_same_config(CapsNetConfig::from_json(j), c);
  // Through text, as in a checkpoint or a config file.
  expect_same_config(CapsNetConfig::from_json(nlohmann::json::parse(j.dump())), c);
  // Missing keys keep their defaults.
  auto partial = CapsNetConfig::from_json(nlohmann::json{{"routing_iterations", 1}, {"reconstruction", false}});
  EXPECT_EQ(partial.routing_iterations, 1);
  EXPECT_FALSE(partial.reconstruction);
  EXPECT_EQ(partial.image_size, 28);
  EXPECT_EQ(partial.num_primary_caps(), 1152);
  expect_same_config(CapsNetConfig::from_json(nlohmann::json::object()), CapsNetConfig{});
  // An integer is accepted where a real is expected.
  EXPECT_EQ(CapsNetConfig::from_json(nlohmann::json::parse(R"({"reconstruction_scale": 1})")).reconstruction_scale,
            1.0);
}

TEST(CapsNetModelTest, ConfigFromJsonRejectsBadInput) {
  using nlohmann::json;
  auto rejects = [](const json& j) {
    EXPECT_THROW(CapsNetConfig::from_json(j), std::invalid_argument) << j.dump();
  };
  rejects(json::parse(R"({"image_sise": 28})"));                 // unknown key (typo)
  rejects(json::parse(R"({"image_size": "28"})"));               // string for an integer
  rejects(json::parse(R"({"image_size": 28.5})"));               // fraction for an integer
  rejects(json::parse(R"({"reconstruction": 1})"));              // number for a bool
  rejects(json::parse(R"({"grad_through_routing": "yes"})"));    // string for a bool
  rejects(json::parse(R"({"reconstruction_scale": [0.1]})"));    // array for a real
  rejects(json::parse(R"({"image_size": 10})"));                 // too small for 9x9 then 9x9
  rejects(json::parse(R"({"image_size": 12, "conv1_kernel": 3, "primary_kernel": 11})"));
  rejects(json::parse(R"({"routing_iterations": 0})"));
  rejects(json::parse(R"({"primary_dim": -8})"));
  rejects(json::parse(R"({"num_classes": 1})"));
  rejects(json::parse(R"({"reconstruction_scale": -0.5})"));
  rejects(json::parse(R"({"init": "xavier"})"));                 // not an initialisation we have
  rejects(json::parse(R"({"init": 1})"));
  rejects(json::parse("[1, 2]"));                                // not an object
  rejects(json::parse("28"));
  // The message names the offending key and says what is wrong with it.
  try {
    CapsNetConfig::from_json(json::parse(R"({"image_sise": 28})"));
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("image_sise"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("unknown"), std::string::npos) << e.what();
  }
  try {
    CapsNetConfig::from_json(json::parse(R"({"image_size": "28"})"));
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("image_size"), std::string::npos) << e.what();
  }
  // The smallest image that fits is accepted: 28 - 9 + 1 = 20 >= 9 ... and 17 - 9 + 1 = 9.
  EXPECT_NO_THROW(CapsNetConfig::from_json(json::parse(R"({"image_size": 17})")));
  EXPECT_THROW(CapsNetConfig::from_json(json::parse(R"({"image_size": 16})")), std::invalid_argument);
  // The constructor validates too.
  CapsNetConfig bad;
  bad.image_size = 16;
  EXPECT_THROW(CapsNet{bad}, std::invalid_argument);
}

TEST(CapsNetModelTest, AdamStepsReduceLoss) {
  capsnet::testing::ScopedThreads one_thread(1);
  torch::manual_seed(25);
  CapsNet model(small_config());
  auto images = torch::rand({8, 1, 12, 12});
  auto labels = torch::tensor({0, 1, 2, 3, 4, 5, 6, 7}, torch::kLong);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto step = [&]() {
    adam.zero_grad();
    auto out = model->forward(images, labels);
    auto l = model->loss(out, images, labels);
    l.total.backward();
    adam.step();
    return std::make_pair(l.margin.item<double>(), l.reconstruction.item<double>());
  };
  const auto first = step();
  std::pair<double, double> last;
  for (int k = 0; k < 30; ++k) last = step();
  EXPECT_LT(last.first, 0.7 * first.first) << "margin loss " << first.first << " -> " << last.first;
  EXPECT_LT(last.second, 0.9 * first.second) << "reconstruction loss " << first.second << " -> " << last.second;
  // And the batch is now classified correctly.
  torch::NoGradGuard g;
  auto predicted = model->forward(images).lengths.argmax(1);
  EXPECT_TRUE(torch::equal(predicted, labels)) << predicted;
}

TEST(CapsNetModelTest, EndToEndGradcheckFloat64) {
  // 8x8 -> conv1 3x3 -> 6x6 -> primary 3x3/2 -> 2x2 x 2 types = 8 capsules of 4D -> 3 x 4D.
  capsnet::testing::ScopedThreads one_thread(1);
  CapsNetConfig c;
  c.image_size = 8;
  c.conv1_channels = 3;
  c.conv1_kernel = 3;
  c.primary_types = 2;
  c.primary_dim = 4;
  c.primary_kernel = 3;
  c.num_classes = 3;
  c.digit_dim = 4;
  for (bool grad_through : {true, false}) {
    c.grad_through_routing = grad_through;
    torch::manual_seed(26);
    CapsNet model(c);
    model->to(torch::kDouble);
    {
      torch::NoGradGuard g;
      model->digit_caps->weight.mul_(50);  // out of the |v| ~ 0 regime, so routing matters
    }
    auto images = torch::rand({2, 1, 8, 8}, torch::kDouble);
    auto labels = torch::tensor({2, 0}, torch::kLong);
    std::vector<torch::Tensor> params;
    for (auto& p : model->parameters()) params.push_back(p);
    ASSERT_EQ(params.size(), 11u);  // conv1 w,b; primary w,b; W; 3 x decoder w,b
    auto outputs = [&](const CapsNetOutput& out) {
      auto l = model->loss(out, images, labels);
      return torch::cat({out.lengths.flatten(), out.reconstruction.flatten(), l.total.reshape({1})});
    };
    auto fn = [&](const std::vector<torch::Tensor>&) { return outputs(model->forward(images, labels)); };
    capsnet::testing::GradcheckOptions o;
    o.max_elements = 6;
    o.seed = 3;
    if (grad_through) {
      EXPECT_TRUE(capsnet::testing::gradcheck(fn, params, o));
    } else {
      // Stop-gradient: value of the same network with the coupling coefficients frozen at the
      // current parameters, gradient of the model (see RoutingTest.GradcheckBothImplementationsBothModes).
      auto primary = [&]() { return model->primary_caps(torch::relu(model->conv1(images))); };
      torch::Tensor coupling;  // [B, I, J, 1]
      {
        torch::NoGradGuard g;
        auto u_hat = model->digit_caps->predictions(primary());
        auto b = torch::zeros({u_hat.size(0), u_hat.size(1), u_hat.size(2)}, u_hat.options());
        for (int64_t t = 0; t + 1 < c.routing_iterations; ++t) {
          auto v = capsnet::squash((torch::softmax(b, 2).unsqueeze(-1) * u_hat).sum(1));
          b = b + (u_hat * v.unsqueeze(1)).sum(-1);
        }
        coupling = torch::softmax(b, 2).unsqueeze(-1);
      }
      auto straight_through = [&](const std::vector<torch::Tensor>&) {
        auto y = fn({});
        CapsNetOutput frozen;
        frozen.digit_caps = capsnet::squash((coupling * model->digit_caps->predictions(primary())).sum(1));
        frozen.lengths = capsnet::capsule_length(frozen.digit_caps);
        frozen.reconstruction = model->decode(frozen.digit_caps, labels);
        return outputs(frozen).detach() + (y - y.detach());
      };
      EXPECT_TRUE(capsnet::testing::gradcheck(straight_through, params, o)) << "stop-gradient";
      // The frozen network is the model at the current parameters.
      torch::NoGradGuard g;
      EXPECT_LT((straight_through({}) - fn({})).abs().max().item<double>(), 1e-12);
    }
  }
}

}  // namespace
