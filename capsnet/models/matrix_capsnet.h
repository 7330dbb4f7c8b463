#pragma once
// The matrix-capsule network of Hinton, Sabour & Frosst (ICLR 2018), Fig. 1, with EM routing:
// ReLU Conv1 A@5x5/2 -> PrimaryCaps B (1x1) -> ConvCaps1 C (3x3/2) -> ConvCaps2 D (3x3/1) -> Class
// capsules (shared weights, coordinate addition). The paper uses A=64, B=C=D=32 on smallNORB (32x32);
// the defaults here are a small variant (A=32, B=C=D=8) that trains on 2 CPU cores.

#include <torch/torch.h>

#include <array>
#include <nlohmann/json.hpp>
#include <string>

#include "capsnet/nn/em_routing.h"
#include "capsnet/nn/matrix_caps.h"
#include "capsnet/kernels/precision.h"

namespace capsnet::models {

/// Architecture and routing hyper-parameters of MatrixCapsNet.
struct MatrixCapsNetConfig {
  int64_t image_channels = 1;
  int64_t image_size = 28;
  int64_t conv1_channels = 32;  // A (paper: 64 for smallNORB)
  int64_t conv1_kernel = 5;
  int64_t conv1_stride = 2;
  int64_t primary_types = 8;  // B (paper: 32)
  int64_t conv1_caps_types = 8;  // C (paper: 32)
  int64_t conv2_caps_types = 8;  // D (paper: 32)
  int64_t caps_kernel = 3;        // K of ConvCaps1 and ConvCaps2
  int64_t conv1_caps_stride = 2;
  int64_t conv2_caps_stride = 1;
  int64_t num_classes = 10;
  int64_t routing_iterations = EmRoutingOptions{}.iterations;
  // Inverse temperature per routing iteration t (0-based): "paper" = the authors' schedule
  // lambda_base (1 - 0.95^(t+1)); "linear" = lambda_first .. lambda_last (the only one in older checkpoints;
  // with lambda = 1 the class activations saturated and training collapsed, docs/em.md).
  std::string lambda_schedule = "paper";
  // lambda_0 of the paper schedule. 1, not the authors' 0.01: their 0.01 multiplies the paper's cost, whose
  // sum_i R_ij is about I / J times the J / I-scaled cost used here (normalize_cost), i.e. ~9-14x larger in
  // this model and ~100x in public reimplementations that learn; measured in docs/em.md.
  double lambda_base = 1.0;
  double lambda_first = 0.01;  // "linear" only
  double lambda_last = 0.01;   // "linear" only
  // EmRoutingOptions::logit_offset_outside_lambda: a_j = logistic(beta_a - lambda cost).
  bool logit_offset_outside_lambda = true;
  // nn::ConvMatrixCapsOptions::cross_window: a child's R sums to 1 over all parents of all its windows.
  bool cross_window_routing = true;
  bool normalize_cost = true;  // EmRoutingOptions::normalize_cost (not in the paper; see em_routing.h)
  // EmRoutingOptions::standardize_cost: costs standardised over the parents of each routing problem
  // before the logistic (not in the paper; needs lambda of order 1, see docs/em.md).
  bool standardize_cost = false;
  // EmRoutingOptions::variance_eps: floor added to every sigma^2 (its log, the E-step's 1/sigma^2). 0.1, not
  // em_routing's 1e-4: with 1e-4 and lambda of order 0.1 training did not start at all (docs/em.md).
  double variance_eps = 0.1;
  bool coordinate_addition = true;

  /// The values a stored config without the newer routing keys means (the model as it was before them):
  /// lambda_schedule "linear", logit_offset_outside_lambda false, cross_window_routing false; and
  /// standardize_cost false and variance_eps 1e-4 for a config written before those keys.
  static nlohmann::json legacy_defaults();
  /// A config from JSON (e.g. a checkpoint's): a missing newer routing key takes its legacy_defaults() value,
  /// any other missing key its default; unknown keys throw (the derived "grid_sides" is ignored).
  static MatrixCapsNetConfig from_json(const nlohmann::json& j);

  /// Sides of the capsule grids: {primary, conv1 caps, conv2 caps} (12, 5, 3 for 28x28 input).
  std::array<int64_t, 3> grid_sides() const;
  /// The routing options every capsule layer uses.
  EmRoutingOptions routing() const;
  /// Throws std::invalid_argument naming the bad field (e.g. an image too small for the kernels).
  void validate() const;
  /// The field list (config_io.h): JSON in both directions is built from it.
  template <class Self, class F>
  static void fields(Self& c, F&& f) {
    f("image_channels", c.image_channels);
    f("image_size", c.image_size);
    f("conv1_channels", c.conv1_channels);
    f("conv1_kernel", c.conv1_kernel);
    f("conv1_stride", c.conv1_stride);
    f("primary_types", c.primary_types);
    f("conv1_caps_types", c.conv1_caps_types);
    f("conv2_caps_types", c.conv2_caps_types);
    f("caps_kernel", c.caps_kernel);
    f("conv1_caps_stride", c.conv1_caps_stride);
    f("conv2_caps_stride", c.conv2_caps_stride);
    f("num_classes", c.num_classes);
    f("routing_iterations", c.routing_iterations);
    f("lambda_schedule", c.lambda_schedule);
    f("lambda_base", c.lambda_base);
    f("lambda_first", c.lambda_first);
    f("lambda_last", c.lambda_last);
    f("logit_offset_outside_lambda", c.logit_offset_outside_lambda);
    f("cross_window_routing", c.cross_window_routing);
    f("normalize_cost", c.normalize_cost);
    f("standardize_cost", c.standardize_cost);
    f("variance_eps", c.variance_eps);
    f("coordinate_addition", c.coordinate_addition);
  }
  nlohmann::json to_json() const;
};

/// Forward result: the class capsules.
struct MatrixCapsNetOutput {
  torch::Tensor poses;        // [N, classes, 16]
  torch::Tensor activations;  // [N, classes] in (0, 1); the prediction is the argmax
};

class MatrixCapsNetImpl : public torch::nn::Cloneable<MatrixCapsNetImpl> {
 public:
  explicit MatrixCapsNetImpl(const MatrixCapsNetConfig& config = {});
  void reset() override;
  /// images: [N, C, S, S] float in [0, 1].
  MatrixCapsNetOutput forward(const torch::Tensor& images);
  /// Precision of the convolutions (Conv1 and PrimaryCaps' two); votes, EM routing and the spread loss
  /// stay fp32 whatever it is. Runtime only: weights and checkpoints stay fp32.
  void set_precision(Precision precision) { precision_ = precision; }
  Precision precision() const { return precision_; }

  MatrixCapsNetConfig config;
  torch::nn::Conv2d conv1{nullptr};
  nn::PrimaryMatrixCaps primary{nullptr};
  nn::ConvMatrixCaps conv_caps1{nullptr}, conv_caps2{nullptr};
  nn::ClassMatrixCaps class_caps{nullptr};

 private:
  Precision precision_ = Precision::kFloat32;
};
TORCH_MODULE(MatrixCapsNet);

}  // namespace capsnet::models
