#pragma once
// Capsule math of Sabour, Frosst & Hinton (2017), as free functions on tensors.
// Paper symbol -> function: v_j = squash(s_j); ||v|| = capsule_length; L_k = margin_loss;
// Procedure 1 = dynamic_routing (fast) / detail::reference_routing (oracle).

#include <torch/torch.h>

namespace capsnet {

/// Epsilon inside the norm of squash and capsule_length: keeps value and gradient finite at s = 0.
inline constexpr double kNormEps = 1e-8;

/// Squash (Eq. 1): v = (|s|^2 / (1 + |s|^2)) * s / sqrt(|s|^2 + eps), along `dim`.
/// s: [..., D] (any shape; `dim` selects the capsule axis). Returns v of the same shape.
torch::Tensor squash(const torch::Tensor& s, int64_t dim = -1, double eps = kNormEps);

/// Capsule length sqrt(|v|^2 + eps) along `dim` (the class probability of a capsule).
/// v: [..., D] -> [...].
torch::Tensor capsule_length(const torch::Tensor& v, int64_t dim = -1, double eps = kNormEps);

/// Margin loss (Eq. 4) parameters.
struct MarginLossOptions {
  double m_plus = 0.9;
  double m_minus = 0.1;
  double lambda = 0.5;
};

/// Margin loss: sum_k T_k max(0, m+ - |v_k|)^2 + lambda (1 - T_k) max(0, |v_k| - m-)^2,
/// summed over classes, averaged over the batch.
/// lengths: [B, K] capsule lengths; labels: [B] int64 in [0, K). Returns a scalar.
torch::Tensor margin_loss(const torch::Tensor& lengths, const torch::Tensor& labels,
                          const MarginLossOptions& options = {});

/// Multi-label margin loss: targets [B, K] in {0, 1} (e.g. two digits in MultiMNIST).
torch::Tensor margin_loss_multi(const torch::Tensor& lengths, const torch::Tensor& targets,
                                const MarginLossOptions& options = {});

/// Keeps only the capsule `index[b]` of each example and flattens for the decoder.
/// v: [B, J, D]; index: [B] int64 in [0, J). Returns [B, J * D] (other capsules zeroed).
torch::Tensor mask(const torch::Tensor& v, const torch::Tensor& index);

/// Reconstruction loss: scale * sum of squared pixel differences, averaged over the batch.
/// reconstruction: [B, P]; target: [B, ...] with P elements per example. Returns a scalar.
torch::Tensor reconstruction_loss(const torch::Tensor& reconstruction, const torch::Tensor& target,
                                  double scale = 0.0005);

/// How capsules route by agreement: the one place these settings and their defaults live. Every
/// capsule layer holds one (`TORCH_ARG(RoutingOptions, routing)`); model configs store its fields.
struct RoutingOptions {
  /// r, the routing iterations (the paper: 3).
  int64_t iterations = 3;
  /// true: gradients flow through the coupling coefficients c_ij (authors' code, default).
  /// false: c_ij are treated as constants (computed from detached predictions).
  bool grad_through_routing = true;
  /// true: the fused operator on CPU tensors (never stores the predictions for the batch);
  /// false, or tensors on other devices: the composite ATen path. Same math, tested equal.
  bool fused = true;
  /// Throws std::invalid_argument naming the field unless iterations >= 1.
  void validate() const;
};

/// Dynamic routing by agreement (Procedure 1), per example, softmax over parents j.
/// u_hat: [B, I, J, D] prediction vectors u_hat_{j|i}. Returns v: [B, J, D].
/// Uses b_ij = u_hat_{j|i} . sum_{t'<t} v_j^(t') and batched matmuls; no [B, I, J, D] temporaries.
torch::Tensor dynamic_routing(const torch::Tensor& u_hat, const RoutingOptions& options = {});

namespace detail {
/// Slow, obviously-correct Procedure 1 with explicit logits b: the test oracle for
/// dynamic_routing and the fused operator. u_hat: [B, I, J, D] -> v: [B, J, D].
torch::Tensor reference_routing(const torch::Tensor& u_hat, const RoutingOptions& options = {});

/// Throws c10::Error with a clear message unless u_hat is [B, I, J, D] floating point and iterations >= 1.
void check_routing_args(const torch::Tensor& u_hat, const RoutingOptions& options);
}  // namespace detail

}  // namespace capsnet
