#include "capsnet/models/baseline_cnn.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/models/config_io.h"
#include "capsnet/models/transformer_front.h"

namespace capsnet::models {

int64_t BaselineCnnConfig::network_size() const { return transformer_front::network_side(stn, image_size, stn_size); }

int64_t BaselineCnnConfig::feature_size() const { return pooling ? network_size() / 2 / 2 : network_size(); }

int64_t BaselineCnnConfig::flattened_features() const {
  return conv3_channels * feature_size() * feature_size();
}

int64_t BaselineCnnConfig::num_parameters() const {
  const int64_t k2 = kernel_size * kernel_size;
  const int64_t convs = image_channels * conv1_channels * k2 + conv1_channels +  // conv1
                        conv1_channels * conv2_channels * k2 + conv2_channels +  // conv2
                        conv2_channels * conv3_channels * k2 + conv3_channels;   // conv3
  const int64_t fcs = flattened_features() * fc1_units + fc1_units +  // fc1
                      fc1_units * fc2_units + fc2_units +             // fc2
                      fc2_units * num_classes + num_classes;          // output
  const int64_t transformer =
      stn ? nn::num_parameters(nn::SpatialTransformerOptions(image_channels, image_size, image_size)) : 0;
  return convs + fcs + transformer;
}

void BaselineCnnConfig::validate() const {
  auto positive = [](const char* name, int64_t value) {
    if (value <= 0)
      throw std::invalid_argument(fmt::format("baseline CNN config: {} must be positive, got {}", name, value));
  };
  positive("image_channels", image_channels);
  positive("image_size", image_size);
  positive("conv1_channels", conv1_channels);
  positive("conv2_channels", conv2_channels);
  positive("conv3_channels", conv3_channels);
  positive("kernel_size", kernel_size);
  positive("fc1_units", fc1_units);
  positive("fc2_units", fc2_units);
  positive("num_classes", num_classes);
  if (kernel_size % 2 == 0)
    throw std::invalid_argument(
        fmt::format("baseline CNN config: kernel_size must be odd for 'same' padding, got {}", kernel_size));
  if (num_classes < 2)
    throw std::invalid_argument(fmt::format("baseline CNN config: num_classes must be at least 2, got {}", num_classes));
  transformer_front::validate("baseline CNN config", stn, stn_size);
  if (feature_size() < 1)
    throw std::invalid_argument(fmt::format("baseline CNN config: {} {} is too small for two 2x2 poolings (needs >= 4)",
                                            transformer_front::side_field(stn, stn_size), network_size()));
  if (!(dropout >= 0 && dropout < 1))
    throw std::invalid_argument(fmt::format("baseline CNN config: dropout must be in [0, 1), got {}", dropout));
}

nlohmann::json BaselineCnnConfig::to_json() const { return config_io::to_json(*this); }

BaselineCnnConfig BaselineCnnConfig::from_json(const nlohmann::json& j) {
  return config_io::from_json<BaselineCnnConfig>(j, "baseline CNN config");
}

BaselineCnnImpl::BaselineCnnImpl(const BaselineCnnConfig& config_) : config(config_) { reset(); }

void BaselineCnnImpl::reset() {
  config.validate();
  const int64_t pad = config.kernel_size / 2;
  auto conv = [&](int64_t in, int64_t out) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, config.kernel_size).stride(1).padding(pad));
  };
  conv1 = register_module("conv1", conv(config.image_channels, config.conv1_channels));
  conv2 = register_module("conv2", conv(config.conv1_channels, config.conv2_channels));
  conv3 = register_module("conv3", conv(config.conv2_channels, config.conv3_channels));
  fc1 = register_module("fc1", torch::nn::Linear(config.flattened_features(), config.fc1_units));
  fc2 = register_module("fc2", torch::nn::Linear(config.fc1_units, config.fc2_units));
  out = register_module("out", torch::nn::Linear(config.fc2_units, config.num_classes));
  drop = register_module("drop", torch::nn::Dropout(torch::nn::DropoutOptions(config.dropout)));
  if (config.stn)
    stn = register_module("stn",
                          transformer_front::make(config.image_channels, config.image_size, config.network_size()));
}

torch::Tensor BaselineCnnImpl::forward(const torch::Tensor& images) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == config.image_channels &&
                  images.size(2) == config.image_size && images.size(3) == config.image_size,
              "BaselineCnn: images must be [B, ", config.image_channels, ", ", config.image_size, ", ",
              config.image_size, "], got ", images.sizes());
  const auto p = precision_;
  auto x = stn ? stn(images) : images;                    // [B, C, N, N], N = network_size()
  x = torch::relu(kernels::conv2d_at(conv1, x, p));            // [B, 256, N, N], compute dtype
  if (config.pooling) x = torch::max_pool2d(x, 2);        // [B, 256, N/2, N/2]
  x = torch::relu(kernels::conv2d_at(conv2, x, p));
  if (config.pooling) x = torch::max_pool2d(x, 2);        // [B, 256, N/4, N/4]
  x = torch::relu(kernels::conv2d_at(conv3, x, p)).flatten(1);  // [B, 128 * F * F]
  x = drop(torch::relu(kernels::linear_at(fc1, x, p)));        // [B, 328]
  x = drop(torch::relu(kernels::linear_at(fc2, x, p)));        // [B, 192]
  // The softmax inside the loss reduces over classes: logits go back to the input's dtype (fp32).
  return kernels::linear_at(out, x, p).to(images.scalar_type());  // logits: [B, K]
}

torch::Tensor BaselineCnnImpl::loss(const torch::Tensor& logits, const torch::Tensor& labels) const {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) == config.num_classes, "BaselineCnn::loss: logits must be [B, ",
              config.num_classes, "], got ", logits.sizes());
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0) && labels.scalar_type() == torch::kLong,
              "BaselineCnn::loss: labels must be int64 [", logits.size(0), "], got ", labels.scalar_type(), " ",
              labels.sizes());
  return torch::nn::functional::cross_entropy(logits, labels);
}

}  // namespace capsnet::models
