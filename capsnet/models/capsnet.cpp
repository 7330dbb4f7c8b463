#include "capsnet/models/capsnet.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <utility>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/models/config_io.h"
#include "capsnet/models/transformer_front.h"

namespace capsnet::models {

int64_t CapsNetConfig::network_size() const { return transformer_front::network_side(stn, image_size, stn_size); }

int64_t CapsNetConfig::conv1_grid() const { return network_size() - conv1_kernel + 1; }

int64_t CapsNetConfig::primary_grid() const { return (conv1_grid() - primary_kernel) / primary_stride + 1; }

int64_t CapsNetConfig::num_primary_caps() const { return primary_types * primary_grid() * primary_grid(); }

double CapsNetConfig::primary_scale() const { return init == "authors" ? 1.0 / double(primary_types) : 1.0; }

void CapsNetConfig::validate() const {
  auto positive = [](const char* name, int64_t value) {
    if (value <= 0) throw std::invalid_argument(fmt::format("model config: {} must be positive, got {}", name, value));
  };
  positive("image_channels", image_channels);
  positive("image_size", image_size);
  positive("conv1_channels", conv1_channels);
  positive("conv1_kernel", conv1_kernel);
  positive("primary_types", primary_types);
  positive("primary_dim", primary_dim);
  positive("primary_kernel", primary_kernel);
  positive("primary_stride", primary_stride);
  positive("num_classes", num_classes);
  positive("digit_dim", digit_dim);
  positive("routing_iterations", routing_iterations);
  if (num_classes < 2) throw std::invalid_argument("model config: num_classes must be at least 2");
  transformer_front::validate("model config", stn, stn_size);
  if (init != "torch" && init != "authors")
    throw std::invalid_argument(fmt::format("model config: init must be \"torch\" or \"authors\", got \"{}\"", init));
  if (conv1_grid() < primary_kernel)
    throw std::invalid_argument(
        fmt::format("model config: {} {} is too small for conv1_kernel {} followed by primary_kernel {}",
                    transformer_front::side_field(stn, stn_size), network_size(), conv1_kernel, primary_kernel));
  if (!(reconstruction_scale >= 0) || !std::isfinite(reconstruction_scale))
    throw std::invalid_argument("model config: reconstruction_scale must be a finite number >= 0");
  // A crafted config must fail here with a sentence, not in an allocation of terabytes.
  constexpr int64_t kMaxDim = 1 << 16;
  for (auto [name, value] : {std::pair<const char*, int64_t>{"image_size", image_size}, {"stn_size", stn_size},
                             {"image_channels", image_channels},
                             {"conv1_channels", conv1_channels}, {"conv1_kernel", conv1_kernel},
                             {"primary_types", primary_types}, {"primary_dim", primary_dim},
                             {"primary_kernel", primary_kernel}, {"primary_stride", primary_stride},
                             {"num_classes", num_classes}, {"digit_dim", digit_dim},
                             {"routing_iterations", routing_iterations}})
    if (value > kMaxDim)
      throw std::invalid_argument(fmt::format("model config: {} is {}, more than the supported {}", name, value, kMaxDim));
  const double grid = static_cast<double>(primary_grid());
  const double params = double(image_channels) * conv1_channels * conv1_kernel * conv1_kernel +
                        double(conv1_channels) * primary_types * primary_dim * primary_kernel * primary_kernel +
                        double(primary_types) * grid * grid * num_classes * digit_dim * primary_dim +
                        (reconstruction ? double(num_classes) * digit_dim * 512 + 512.0 * 1024 +
                                              1024.0 * image_channels * image_size * image_size
                                        : 0.0);
  if (params > 2e9)
    throw std::invalid_argument(fmt::format("model config: {:.3g} parameters, more than the supported 2e9", params));
}

nlohmann::json CapsNetConfig::to_json() const { return config_io::to_json(*this); }

CapsNetConfig CapsNetConfig::from_json(const nlohmann::json& j) {
  return config_io::from_json<CapsNetConfig>(j, "model config");
}

CapsNetImpl::CapsNetImpl(const CapsNetConfig& config_) : config(config_) { reset(); }

void CapsNetImpl::reset() {
  config.validate();
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(
                                                         config.image_channels, config.conv1_channels,
                                                         config.conv1_kernel)));
  primary_caps = register_module(
      "primary_caps", nn::PrimaryCaps(nn::PrimaryCapsOptions(config.conv1_channels, config.primary_types,
                                                             config.primary_dim)
                                          .kernel_size(config.primary_kernel)
                                          .stride(config.primary_stride)
                                          .output_scale(config.primary_scale())));
  digit_caps = register_module(
      "digit_caps", nn::CapsuleLinear(nn::CapsuleLinearOptions(config.num_primary_caps(), config.primary_dim,
                                                               config.num_classes, config.digit_dim)
                                          .routing({config.routing_iterations, config.grad_through_routing})));
  if (config.reconstruction) {
    const int64_t pixels = config.image_channels * config.image_size * config.image_size;
    decoder = register_module("decoder",
                              nn::Decoder(nn::DecoderOptions(config.num_classes * config.digit_dim, pixels)));
  }
  if (config.stn)
    stn = register_module("stn",
                          transformer_front::make(config.image_channels, config.image_size, config.network_size()));
  if (config.init == "authors") init_as_authors();
}

namespace {
// TensorFlow's truncated_normal_initializer(stddev): N(0, std^2) redrawn outside two standard deviations.
void truncated_normal_(torch::Tensor& w, double std) {
  auto z = torch::randn(w.sizes(), w.options());
  for (auto out = z.abs() > 2.0; out.any().item<bool>(); out = z.abs() > 2.0)
    z.masked_scatter_(out, torch::randn({out.sum().item<int64_t>()}, w.options()));
  w.copy_(z * std);
}
}  // namespace

void CapsNetImpl::init_as_authors() {
  torch::NoGradGuard no_grad;
  truncated_normal_(conv1->weight, 0.05);
  conv1->bias.fill_(0.1);
  truncated_normal_(primary_caps->conv->weight, 0.1);
  // s = scale * (W * x + b_conv): the authors' bias (0.1, added after the division) is scale * b_conv.
  primary_caps->conv->bias.fill_(0.1 / config.primary_scale());
  truncated_normal_(digit_caps->weight, 0.1);  // the authors' DigitCaps also has a bias per atom: not here
  if (decoder)
    for (auto* fc : {&decoder->fc1, &decoder->fc2, &decoder->fc3}) {
      truncated_normal_((*fc)->weight, 0.1);
      (*fc)->bias.fill_(0.1);
    }
}

CapsNetOutput CapsNetImpl::forward(const torch::Tensor& images, const std::optional<torch::Tensor>& labels) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == config.image_channels &&
                  images.size(2) == config.image_size && images.size(3) == config.image_size,
              "CapsNet: images must be [B, ", config.image_channels, ", ", config.image_size, ", ",
              config.image_size, "], got ", images.sizes());
  CapsNetOutput out;
  // The decoder still reconstructs (and the loss compares with) the untransformed input.
  const auto x = stn ? stn(images) : images;      // [B, C, N, N], N = network_size()
  // conv1 -> ReLU -> PrimaryCaps conv run in the compute precision; u is fp32. Without autograd the
  // three stay in oneDNN's blocked layout with weights reordered once (kernels/blocked_conv.h). The ReLU is
  // PrimaryCaps' (relu_input): fused into its convolution where that can (kernels/conv_dispatch.h). Its inference
  // caches (the spectral form's weight spectrum after each weight update) are made before Conv1's output
  // exists, and that output is handed over, not held here.
  primary_caps->prepare({x.size(0), config.conv1_channels, config.conv1_grid(), config.conv1_grid()}, precision_);
  auto u = primary_caps(kernels::conv2d_at(conv1, x, precision_, &conv1_blocked_), precision_, /*relu_input=*/true);  // [B, I, 8]
  out.digit_caps = digit_caps(u);                      // [B, K, 16]
  out.lengths = capsule_length(out.digit_caps);        // [B, K]
  if (decoder) {
    auto which = labels ? *labels : out.lengths.argmax(1);
    out.reconstruction = decode(out.digit_caps, which);
  }
  return out;
}

torch::Tensor CapsNetImpl::decode(const torch::Tensor& v, const torch::Tensor& which) {
  TORCH_CHECK(decoder, "CapsNet: this model has no decoder (reconstruction disabled)");
  return decoder(mask(v, which), precision_);
}

CapsNetLoss CapsNetImpl::loss(const CapsNetOutput& out, const torch::Tensor& images,
                              const torch::Tensor& labels) const {
  CapsNetLoss l;
  l.margin = margin_loss(out.lengths, labels);
  l.reconstruction = out.reconstruction.defined()
                         ? reconstruction_loss(out.reconstruction, images, config.reconstruction_scale)
                         : torch::zeros({}, l.margin.options());
  l.total = l.margin + l.reconstruction;
  return l;
}

bool same_config(const nlohmann::json& stored, const CapsNetConfig& config) {
  try {
    return CapsNetConfig::from_json(stored).to_json() == config.to_json();
  } catch (const std::exception&) {
    return false;
  }
}

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace capsnet::models
