#pragma once
// The MNIST CapsNet of Sabour et al. (2017), Fig. 1 and 2:
// Conv1 256@9x9 ReLU -> PrimaryCaps 32x8D @9x9/2 -> DigitCaps 10x16D (routing) -> masked decoder.

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "capsnet/nn/capsule_linear.h"
#include "capsnet/nn/decoder.h"
#include "capsnet/nn/functional.h"
#include "capsnet/nn/primary_caps.h"
#include "capsnet/nn/spatial_transformer.h"

namespace capsnet::models {

/// Architecture hyper-parameters; defaults are the paper's MNIST model (8,215,568 parameters).
struct CapsNetConfig {
  int64_t image_channels = 1;
  int64_t image_size = 28;
  int64_t conv1_channels = 256;
  int64_t conv1_kernel = 9;
  int64_t primary_types = 32;
  int64_t primary_dim = 8;
  int64_t primary_kernel = 9;
  int64_t primary_stride = 2;
  int64_t num_classes = 10;
  int64_t digit_dim = 16;
  int64_t routing_iterations = RoutingOptions{}.iterations;
  bool grad_through_routing = RoutingOptions{}.grad_through_routing;
  bool reconstruction = true;  // decoder + 0.0005 * SSE term
  double reconstruction_scale = 0.0005;
  bool stn = false;  // a SpatialTransformer warps the input first (Jaderberg et al. 2015); absent in old configs
  int64_t stn_size = 0;  // with stn: side of the transformer's output, which Conv1 sees (0 = image_size)
  /// "torch": LibTorch's default initialisation, DigitCaps W ~ N(0, 0.01^2). "authors": the authors' public code
  /// (research/capsules): truncated normals (Conv1 sigma 0.05; PrimaryCaps, DigitCaps W and decoder 0.1), biases
  /// 0.1, and PrimaryCaps' convolution divided by primary_types (its one routing iteration over the types). The
  /// division is part of the network (primary_scale()), so the field stays in the config after training.
  std::string init = "torch";

  /// Side of the image Conv1 sees: stn_size with a spatial transformer that resamples, else image_size.
  int64_t network_size() const;
  /// Side of Conv1's output (20 for the paper's model: a valid 9 x 9 convolution of 28 x 28).
  int64_t conv1_grid() const;
  /// Side of the PrimaryCaps grid (6 for the paper's model).
  int64_t primary_grid() const;
  /// Number of primary capsules I (1152 for the paper's model).
  int64_t num_primary_caps() const;
  /// PrimaryCaps' output scale: 1 / primary_types with init "authors", else 1.
  double primary_scale() const;
  /// Throws std::invalid_argument naming the bad field (e.g. an image too small for the kernels).
  void validate() const;
  /// The field list (config_io.h): JSON in both directions is built from it.
  template <class Self, class F>
  static void fields(Self& c, F&& f) {
    f("image_channels", c.image_channels);
    f("image_size", c.image_size);
    f("conv1_channels", c.conv1_channels);
    f("conv1_kernel", c.conv1_kernel);
    f("primary_types", c.primary_types);
    f("primary_dim", c.primary_dim);
    f("primary_kernel", c.primary_kernel);
    f("primary_stride", c.primary_stride);
    f("num_classes", c.num_classes);
    f("digit_dim", c.digit_dim);
    f("routing_iterations", c.routing_iterations);
    f("grad_through_routing", c.grad_through_routing);
    f("reconstruction", c.reconstruction);
    f("reconstruction_scale", c.reconstruction_scale);
    f("stn", c.stn);
    f("stn_size", c.stn_size);
    f("init", c.init);
  }
  nlohmann::json to_json() const;
  /// Missing keys keep their defaults; unknown keys and wrong types throw std::invalid_argument.
  static CapsNetConfig from_json(const nlohmann::json& j);
};

struct CapsNetOutput {
  torch::Tensor digit_caps;      // v: [B, K, D]
  torch::Tensor lengths;         // |v|: [B, K]
  torch::Tensor reconstruction;  // [B, C*H*W] in (0, 1); undefined without a decoder
};

struct CapsNetLoss {
  torch::Tensor total, margin, reconstruction;  // scalars (reconstruction = 0 without a decoder)
};

class CapsNetImpl : public torch::nn::Cloneable<CapsNetImpl> {
 public:
  explicit CapsNetImpl(const CapsNetConfig& config = {});
  void reset() override;

  /// images: [B, C, H, W] float in [0, 1]. The decoder sees the capsule of `labels` when given
  /// (training) and the longest capsule otherwise (inference).
  CapsNetOutput forward(const torch::Tensor& images, const std::optional<torch::Tensor>& labels = std::nullopt);
  /// Decodes one (masked) capsule per example. v: [B, K, D]; which: [B] -> [B, C*H*W].
  torch::Tensor decode(const torch::Tensor& v, const torch::Tensor& which);
  /// Routes with the fused operator (default) or the composite reference-style path; same math.
  void set_fused_routing(bool fused) { digit_caps->options.routing().fused = fused; }
  /// Precision of the convolutions and the decoder (runtime only: weights and checkpoints stay fp32).
  void set_precision(Precision precision) { precision_ = precision; }
  Precision precision() const { return precision_; }
  /// margin loss + reconstruction_scale * SSE (paper Sec. 4.1).
  CapsNetLoss loss(const CapsNetOutput& out, const torch::Tensor& images, const torch::Tensor& labels) const;

  /// Re-initialises the weights as config.init "authors" describes (reset() calls it for that init).
  void init_as_authors();

  CapsNetConfig config;
  torch::nn::Conv2d conv1{nullptr};
  nn::PrimaryCaps primary_caps{nullptr};
  nn::CapsuleLinear digit_caps{nullptr};
  nn::Decoder decoder{nullptr};
  nn::SpatialTransformer stn{nullptr};  // only with config.stn

 private:
  Precision precision_ = Precision::kFloat32;
  kernels::BlockedConvWeights conv1_blocked_;  // conv1's weights in oneDNN's layout, for inference
};
TORCH_MODULE(CapsNet);

/// Whether a stored config (e.g. a checkpoint's) describes `config`. Compared through from_json: a
/// checkpoint written before a field existed stores no key for it, which means the field's default.
/// A config that does not parse does not match.
bool same_config(const nlohmann::json& stored, const CapsNetConfig& config);

/// Number of trainable scalars in a module.
int64_t count_parameters(const torch::nn::Module& module);

}  // namespace capsnet::models
