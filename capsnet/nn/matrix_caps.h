#pragma once
// Matrix-capsule layers of Hinton, Sabour & Frosst (ICLR 2018), Sec. 3 and Fig. 1:
// PrimaryMatrixCaps (conv -> 4x4 pose + logistic activation), ConvMatrixCaps (K x K convolutional
// capsules routed with EM), ClassMatrixCaps (one capsule per class, weights shared across positions,
// coordinate addition). A capsule grid is a MatrixCaps: poses [N, H, W, T, 16], activations [N, H, W, T].

#include <torch/torch.h>

#include "capsnet/nn/em_routing.h"
#include "capsnet/kernels/precision.h"

namespace capsnet::nn {

/// Pose side: poses are 4x4 matrices, stored flattened row-major as 16 numbers.
inline constexpr int64_t kPoseSide = 4;
inline constexpr int64_t kPoseSize = kPoseSide * kPoseSide;

/// A grid of matrix capsules of T types at H x W positions.
struct MatrixCaps {
  torch::Tensor poses;        // M: [N, H, W, T, 16] (4x4 row-major)
  torch::Tensor activations;  // a: [N, H, W, T] in (0, 1)
};

struct PrimaryMatrixCapsOptions {
  PrimaryMatrixCapsOptions(int64_t in_channels, int64_t capsule_types)
      : in_channels_(in_channels), capsule_types_(capsule_types) {}
  TORCH_ARG(int64_t, in_channels);    // A in the paper (32)
  TORCH_ARG(int64_t, capsule_types);  // B in the paper (32)
  TORCH_ARG(int64_t, kernel_size) = 1;  // the paper uses 1x1
  TORCH_ARG(int64_t, stride) = 1;
};

/// PrimaryCaps: one convolution with T * 16 pose channels and T activation channels (logistic).
/// x: [N, in_channels, H, W] -> MatrixCaps with poses [N, H', W', T, 16], activations [N, H', W', T].
/// `precision` is that of the two convolutions only; poses and activations come back in the weights'
/// dtype (fp32), so votes and EM routing never see bf16.
class PrimaryMatrixCapsImpl : public torch::nn::Cloneable<PrimaryMatrixCapsImpl> {
 public:
  explicit PrimaryMatrixCapsImpl(const PrimaryMatrixCapsOptions& options);
  void reset() override;
  MatrixCaps forward(const torch::Tensor& x, Precision precision = Precision::kFloat32);

  PrimaryMatrixCapsOptions options;
  torch::nn::Conv2d pose{nullptr}, activation{nullptr};
};
TORCH_MODULE(PrimaryMatrixCaps);

struct ConvMatrixCapsOptions {
  ConvMatrixCapsOptions(int64_t in_types, int64_t out_types) : in_types_(in_types), out_types_(out_types) {}
  TORCH_ARG(int64_t, in_types);   // child capsule types B_in
  TORCH_ARG(int64_t, out_types);  // parent capsule types C
  TORCH_ARG(int64_t, kernel_size) = 3;  // K
  TORCH_ARG(int64_t, stride) = 1;
  /// true (the paper): a child's R is normalised over the C parents of every window that contains it
  /// (it splits its unit of vote over all of them). false (the earlier routing): over the C parents of each
  /// window separately, as if every window had its own copy of the child.
  TORCH_ARG(bool, cross_window) = true;
  TORCH_ARG(EmRoutingOptions, routing) = {};
};

/// Where the windows of a K x K, stride s convolution (no padding) over an N x H x W grid of B_in
/// child types lie: H' = (H - K) / s + 1 rows and W' = (W - K) / s + 1 columns of windows.
struct WindowGeometry {
  int64_t batch = 1, height = 1, width = 1, in_types = 1, kernel = 1, stride = 1;
  int64_t out_height() const { return (height - kernel) / stride + 1; }
  int64_t out_width() const { return (width - kernel) / stride + 1; }
};

/// The E-step normaliser of a convolutional capsule layer (EmRoutingOptions::child_log_total): for each
/// (window, child) entry, log of sum_{windows w' containing the child} sum_c a_c p_{child, c}(w').
/// log_weights: [N*H'*W', K*K*B_in, C] (windows in (n, y, x) order, children in (ky, kx, b_in) order)
///   -> [N*H'*W', K*K*B_in, 1]. Children at the border belong to fewer windows.
torch::Tensor cross_window_child_log_total(const torch::Tensor& log_weights, const WindowGeometry& geometry);

/// Convolutional capsules (Sec. 3, Fig. 1 ConvCaps1/2). Each parent position (y, x) routes the
/// I = K*K*B_in children of its K x K window (stride s, no padding) to its C parent types:
/// vote V_ij = M_i W_{(ky,kx,b_in), c} (pose times a learned 4x4 matrix, one matrix per kernel offset,
/// child type and parent type, shared across positions), then em_routing with per-type beta_u, beta_a.
/// With cross_window (default) the E-step normalises a child's R over every parent of every window
/// that contains it (cross_window_child_log_total), as in the paper; the M-step of each parent still
/// sees only the children of its window.
/// in: poses [N, H, W, B_in, 16], activations [N, H, W, B_in]
///   -> poses [N, H', W', C, 16], activations [N, H', W', C] with H' = (H - K) / s + 1.
class ConvMatrixCapsImpl : public torch::nn::Cloneable<ConvMatrixCapsImpl> {
 public:
  explicit ConvMatrixCapsImpl(const ConvMatrixCapsOptions& options);
  void reset() override;
  MatrixCaps forward(const MatrixCaps& in);
  /// The votes and child activations of every window, before routing:
  /// votes [N * H' * W', K*K*B_in, C, 16], activations [N * H' * W', K*K*B_in] (windows in (n, y, x) order,
  /// children in (ky, kx, b_in) order).
  std::pair<torch::Tensor, torch::Tensor> votes(const MatrixCaps& in) const;
  /// The window geometry of this layer on `in`.
  WindowGeometry geometry(const MatrixCaps& in) const;
  /// The routing options forward() uses on `in` (options.routing() plus the cross-window normaliser).
  EmRoutingOptions routing_options(const MatrixCaps& in) const;

  ConvMatrixCapsOptions options;
  torch::Tensor weight;  // W: [K*K*B_in, C, 4, 4]
  torch::Tensor beta_u, beta_a;  // [C]
};
TORCH_MODULE(ConvMatrixCaps);

struct ClassMatrixCapsOptions {
  ClassMatrixCapsOptions(int64_t in_types, int64_t num_classes) : in_types_(in_types), num_classes_(num_classes) {}
  TORCH_ARG(int64_t, in_types);
  TORCH_ARG(int64_t, num_classes);
  TORCH_ARG(bool, coordinate_addition) = true;
  TORCH_ARG(EmRoutingOptions, routing) = {};
};

/// Class capsules (Sec. 3, "Coordinate Addition"): every child capsule at every position votes for
/// each class with one 4x4 matrix per (child type, class), shared across positions; with
/// coordinate_addition the scaled centre (row, column) = ((y + 0.5) / H, (x + 0.5) / W) of the child's
/// position is added to the first two elements of the right-hand column of its vote matrix
/// (elements [0][3] and [1][3]). All I = H*W*B_in children are routed to the classes by EM.
/// in: poses [N, H, W, B_in, 16], activations [N, H, W, B_in] -> poses [N, classes, 16], activations [N, classes].
class ClassMatrixCapsImpl : public torch::nn::Cloneable<ClassMatrixCapsImpl> {
 public:
  explicit ClassMatrixCapsImpl(const ClassMatrixCapsOptions& options);
  void reset() override;
  EmRoutingResult forward(const MatrixCaps& in);
  /// votes [N, H*W*B_in, classes, 16] (children in (y, x, b_in) order) and activations [N, H*W*B_in].
  std::pair<torch::Tensor, torch::Tensor> votes(const MatrixCaps& in) const;

  ClassMatrixCapsOptions options;
  torch::Tensor weight;  // W: [B_in, classes, 4, 4]
  torch::Tensor beta_u, beta_a;  // [classes]
};
TORCH_MODULE(ClassMatrixCaps);

/// Throws std::invalid_argument naming `who` unless `in` is a consistent grid with `types` capsule types.
void check_matrix_caps(const MatrixCaps& in, int64_t types, const char* who);

namespace detail {
/// Slow, obviously-correct EM routing of a convolutional capsule layer written from Procedure 1 with an
/// explicit global child index g = (n, y, x, b_in): loops over windows, children, parents and pose
/// elements on scalar tensors, p with exp as printed; the E-step divides a_c p by the child's total over
/// every parent of every window containing g (options.child_log_total is ignored: this is its oracle).
/// With cross_window = false each window is normalised on its own. votes [N*H'*W', K*K*B_in, C, D],
/// activations [N*H'*W', K*K*B_in] as ConvMatrixCaps::votes returns them; beta_u, beta_a: [C] or one
/// element. Returns poses [N*H'*W', C, D], activations [N*H'*W', C]. Autograd runs through it.
EmRoutingResult reference_conv_em_routing(const torch::Tensor& votes, const torch::Tensor& activations,
                                          const torch::Tensor& beta_u, const torch::Tensor& beta_a,
                                          const EmRoutingOptions& options, const WindowGeometry& geometry,
                                          bool cross_window = true);
}  // namespace detail

}  // namespace capsnet::nn
