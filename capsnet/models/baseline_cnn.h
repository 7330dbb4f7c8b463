#pragma once
// The baseline CNN of Sabour et al. (2017), Sec. 5: three 5x5 stride-1 convolutions with 256, 256 and
// 128 channels (ReLU), two fully connected layers of 328 and 192 units (ReLU, dropout) and a 10-way
// linear output trained with cross-entropy (softmax inside the loss).
//
// The paper gives neither padding nor pooling. Ours: "same" padding (2 px) on every convolution and,
// by default, a 2x2 max-pool after conv1 and after conv2 (pooling = true), dropout 0.5. Parameter
// counts (formula: BaselineCnnConfig::num_parameters):
//
//   image   pooling   flattened conv3 output   parameters
//   28x28   yes       128 x 7 x 7   =   6272    4,587,282
//   40x40   yes       128 x 10 x 10 =  12800    6,728,466
//   28x28   no        128 x 28 x 28 = 100352   35,445,522   (the paper's "35.4M")
//   40x40   no        128 x 40 x 40 = 204800   69,704,466
//
// Only the unpooled 28x28 variant matches the paper's 35.4M, which suggests (does not prove) that the
// paper's CNN had no pooling. We default to pooling because the unpooled net costs ~4x the
// convolution work and 5-10x the parameters, which this project's CPU experiments cannot afford;
// pooling = false builds the 35.4M variant.

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "capsnet/kernels/precision.h"
#include "capsnet/nn/spatial_transformer.h"

namespace capsnet::models {

/// Architecture hyper-parameters; defaults are the paper's baseline with our pooling choice (above).
struct BaselineCnnConfig {
  int64_t image_channels = 1;
  int64_t image_size = 28;  // square inputs; 28 (MNIST) and 40 (affNIST-style canvas) are used
  int64_t conv1_channels = 256;
  int64_t conv2_channels = 256;
  int64_t conv3_channels = 128;
  int64_t kernel_size = 5;  // odd: "same" padding of kernel_size / 2 keeps the spatial size
  bool pooling = true;      // 2x2 max-pool (floor) after conv1 and after conv2
  int64_t fc1_units = 328;
  int64_t fc2_units = 192;
  int64_t num_classes = 10;
  double dropout = 0.5;  // after each hidden FC layer, training only; the paper gives no rate
  bool stn = false;      // a SpatialTransformer warps the input first (Jaderberg et al. 2015)
  int64_t stn_size = 0;  // with stn: side of the transformer's output, which conv1 sees (0 = image_size)

  /// Side of the image conv1 sees: stn_size with a spatial transformer that resamples, else image_size.
  int64_t network_size() const;
  /// Side of the conv3 feature map: network_size(), or network_size() / 2 / 2 (floor) with pooling.
  int64_t feature_size() const;
  /// Inputs of fc1: conv3_channels * feature_size()^2.
  int64_t flattened_features() const;
  /// Trainable scalars of the model this config builds (weights + biases of every layer, incl. the STN).
  int64_t num_parameters() const;
  /// Throws std::invalid_argument naming the bad field and value.
  void validate() const;
  /// The field list (config_io.h): JSON in both directions is built from it.
  template <class Self, class F>
  static void fields(Self& c, F&& f) {
    f("image_channels", c.image_channels);
    f("image_size", c.image_size);
    f("conv1_channels", c.conv1_channels);
    f("conv2_channels", c.conv2_channels);
    f("conv3_channels", c.conv3_channels);
    f("kernel_size", c.kernel_size);
    f("pooling", c.pooling);
    f("fc1_units", c.fc1_units);
    f("fc2_units", c.fc2_units);
    f("num_classes", c.num_classes);
    f("dropout", c.dropout);
    f("stn", c.stn);
    f("stn_size", c.stn_size);
  }
  nlohmann::json to_json() const;
  /// Missing keys keep their defaults; unknown keys and wrong types throw std::invalid_argument.
  static BaselineCnnConfig from_json(const nlohmann::json& j);
};

class BaselineCnnImpl : public torch::nn::Cloneable<BaselineCnnImpl> {
 public:
  explicit BaselineCnnImpl(const BaselineCnnConfig& config = {});
  void reset() override;

  /// images: [B, C, S, S] float in [0, 1] (S = config.image_size). Returns logits [B, K] in the
  /// images' dtype whatever the precision. Dropout is active only in train() mode; in eval() mode the
  /// output is deterministic.
  torch::Tensor forward(const torch::Tensor& images);
  /// Mean cross-entropy of softmax(logits) against labels. logits: [B, K]; labels: [B] int64 in [0, K).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& labels) const;

  /// Compute precision of the convolutions and fully connected layers (kernels/conv_dispatch.h); weights stay
  /// fp32 and the spatial transformer, when there is one, computes in fp32. Not part of the config:
  /// checkpoints load under either precision.
  void set_precision(Precision precision) { precision_ = precision; }
  Precision precision() const { return precision_; }

  BaselineCnnConfig config;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
  nn::SpatialTransformer stn{nullptr};  // only with config.stn

 private:
  Precision precision_ = Precision::kFloat32;
};
TORCH_MODULE(BaselineCnn);

}  // namespace capsnet::models
