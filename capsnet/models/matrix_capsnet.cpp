#include "capsnet/models/matrix_capsnet.h"

#include <fmt/format.h>

#include <stdexcept>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/models/config_io.h"

namespace capsnet::models {

std::array<int64_t, 3> MatrixCapsNetConfig::grid_sides() const {
  const int64_t primary = (image_size - conv1_kernel) / conv1_stride + 1;
  const int64_t caps1 = (primary - caps_kernel) / conv1_caps_stride + 1;
  const int64_t caps2 = (caps1 - caps_kernel) / conv2_caps_stride + 1;
  return {primary, caps1, caps2};
}

EmRoutingOptions MatrixCapsNetConfig::routing() const {
  EmRoutingOptions o;
  o.iterations = routing_iterations;
  o.inverse_temperature = lambda_schedule == "paper"
                              ? paper_inverse_temperature_schedule(routing_iterations, lambda_base)
                              : inverse_temperature_schedule(routing_iterations, lambda_first, lambda_last);
  o.logit_offset_outside_lambda = logit_offset_outside_lambda;
  o.normalize_cost = normalize_cost;
  o.standardize_cost = standardize_cost;
  o.variance_eps = variance_eps;
  return o;
}

nlohmann::json MatrixCapsNetConfig::legacy_defaults() {
  return {{"lambda_schedule", "linear"},
          {"logit_offset_outside_lambda", false},
          {"cross_window_routing", false},
          {"standardize_cost", false},
          {"variance_eps", 1e-4}};
}

MatrixCapsNetConfig MatrixCapsNetConfig::from_json(const nlohmann::json& j) {
  auto filled = j;
  if (filled.is_object()) {
    filled.erase("grid_sides");  // derived (to_json writes it for readers)
    const auto legacy = legacy_defaults();  // a named object: items() of a temporary would dangle
    for (const auto& [key, value] : legacy.items())
      if (!filled.contains(key)) filled[key] = value;
  }
  return config_io::from_json<MatrixCapsNetConfig>(filled, "matrix capsnet config");
}

void MatrixCapsNetConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    if (v < 1) throw std::invalid_argument(fmt::format("MatrixCapsNetConfig: {} must be >= 1, got {}", name, v));
  };
  positive(image_channels, "image_channels");
  positive(image_size, "image_size");
  positive(conv1_channels, "conv1_channels");
  positive(conv1_kernel, "conv1_kernel");
  positive(conv1_stride, "conv1_stride");
  positive(primary_types, "primary_types");
  positive(conv1_caps_types, "conv1_caps_types");
  positive(conv2_caps_types, "conv2_caps_types");
  positive(caps_kernel, "caps_kernel");
  positive(conv1_caps_stride, "conv1_caps_stride");
  positive(conv2_caps_stride, "conv2_caps_stride");
  positive(routing_iterations, "routing_iterations");
  if (num_classes < 2)
    throw std::invalid_argument(fmt::format("MatrixCapsNetConfig: num_classes must be >= 2, got {}", num_classes));
  if (lambda_schedule != "paper" && lambda_schedule != "linear")
    throw std::invalid_argument(
        fmt::format("MatrixCapsNetConfig: lambda_schedule must be \"paper\" or \"linear\", got \"{}\"", lambda_schedule));
  if (!(variance_eps > 0))
    throw std::invalid_argument(fmt::format("MatrixCapsNetConfig: variance_eps must be > 0, got {}", variance_eps));
  if (!(lambda_base > 0)) throw std::invalid_argument(fmt::format("MatrixCapsNetConfig: lambda_base must be > 0, got {}", lambda_base));
  if (!(lambda_first > 0) || !(lambda_last > 0))
    throw std::invalid_argument("MatrixCapsNetConfig: lambda_first and lambda_last must be > 0");
  if (image_size < conv1_kernel)
    throw std::invalid_argument(fmt::format("MatrixCapsNetConfig: image_size {} is smaller than conv1_kernel {}",
                                            image_size, conv1_kernel));
  const auto sides = grid_sides();
  const int64_t primary = (image_size - conv1_kernel) / conv1_stride + 1;
  if (primary < caps_kernel || sides[1] < caps_kernel)
    throw std::invalid_argument(fmt::format(
        "MatrixCapsNetConfig: image_size {} is too small: capsule grids {}x{} -> {}x{} cannot hold caps_kernel {}",
        image_size, primary, primary, sides[1], sides[1], caps_kernel));
}

nlohmann::json MatrixCapsNetConfig::to_json() const {
  auto j = config_io::to_json(*this);
  j["grid_sides"] = grid_sides();  // derived, for readers of the metrics
  return j;
}

MatrixCapsNetImpl::MatrixCapsNetImpl(const MatrixCapsNetConfig& config_) : config(config_) { reset(); }

void MatrixCapsNetImpl::reset() {
  config.validate();
  const auto routing = config.routing();
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(config.image_channels,
                                                                              config.conv1_channels, config.conv1_kernel)
                                                         .stride(config.conv1_stride)));
  primary = register_module("primary", nn::PrimaryMatrixCaps(nn::PrimaryMatrixCapsOptions(config.conv1_channels,
                                                                                           config.primary_types)));
  // The two convolutional capsule layers differ only in their types and stride.
  const auto conv_caps = [&](int64_t in_types, int64_t out_types, int64_t stride) {
    return nn::ConvMatrixCaps(nn::ConvMatrixCapsOptions(in_types, out_types)
                                  .kernel_size(config.caps_kernel)
                                  .stride(stride)
                                  .cross_window(config.cross_window_routing)
                                  .routing(routing));
  };
  conv_caps1 =
      register_module("conv_caps1", conv_caps(config.primary_types, config.conv1_caps_types, config.conv1_caps_stride));
  conv_caps2 = register_module("conv_caps2",
                               conv_caps(config.conv1_caps_types, config.conv2_caps_types, config.conv2_caps_stride));
  class_caps = register_module(
      "class_caps", nn::ClassMatrixCaps(nn::ClassMatrixCapsOptions(config.conv2_caps_types, config.num_classes)
                                            .coordinate_addition(config.coordinate_addition)
                                            .routing(routing)));
}

MatrixCapsNetOutput MatrixCapsNetImpl::forward(const torch::Tensor& images) {
  if (!images.defined() || images.dim() != 4 || images.size(1) != config.image_channels ||
      images.size(2) != config.image_size || images.size(3) != config.image_size)
    throw std::invalid_argument(fmt::format("MatrixCapsNet: images must be [N, {}, {}, {}]", config.image_channels,
                                            config.image_size, config.image_size));
  // Conv1 and PrimaryCaps' convolutions in the compute precision; PrimaryCaps hands back fp32 capsules.
  auto x = torch::relu(kernels::conv2d_at(conv1, images, precision_).to(conv1->weight.scalar_type()));  // [N, A, S1, S1]
  auto caps = primary->forward(x, precision_);  // [N, S1, S1, B, 16]
  caps = conv_caps1->forward(caps);              // [N, S2, S2, C, 16]
  caps = conv_caps2->forward(caps);              // [N, S3, S3, D, 16]
  auto r = class_caps->forward(caps);            // [N, classes, 16], [N, classes]
  return {r.poses, r.activations};
}

}  // namespace capsnet::models
