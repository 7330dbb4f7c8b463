#include "capsnet/nn/matrix_caps.h"

#include <fmt/format.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace capsnet::nn {
namespace {

// Transformation matrices start near a scaled identity: votes then start close to the children's
// poses, so routing groups children that agree from the first step instead of random projections.
torch::Tensor init_transforms(at::IntArrayRef leading) {
  std::vector<int64_t> sizes(leading.begin(), leading.end());
  sizes.push_back(kPoseSide);
  sizes.push_back(kPoseSide);
  return torch::eye(kPoseSide) + 0.5 * torch::randn(sizes);
}

std::string shape(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void check_positive(int64_t value, const char* who, const char* name) {
  if (value < 1) throw std::invalid_argument(fmt::format("{}: {} must be >= 1, got {}", who, name, value));
}

}  // namespace

void check_matrix_caps(const MatrixCaps& in, int64_t types, const char* who) {
  if (!in.poses.defined() || in.poses.dim() != 5 || in.poses.size(3) != types || in.poses.size(4) != kPoseSize)
    throw std::invalid_argument(fmt::format("{}: poses must be [N, H, W, {}, 16], got {}", who, types,
                                            shape(in.poses)));
  if (!in.activations.defined() || in.activations.sizes() != in.poses.sizes().slice(0, 4))
    throw std::invalid_argument(fmt::format("{}: activations must be [N, H, W, {}] matching the poses, got {}", who,
                                            types,
                                            shape(in.activations)));
}

// --- PrimaryMatrixCaps ---------------------------------------------------------------------------

PrimaryMatrixCapsImpl::PrimaryMatrixCapsImpl(const PrimaryMatrixCapsOptions& options_) : options(options_) { reset(); }

void PrimaryMatrixCapsImpl::reset() {
  const char* who = "PrimaryMatrixCaps";
  check_positive(options.in_channels(), who, "in_channels");
  check_positive(options.capsule_types(), who, "capsule_types");
  check_positive(options.kernel_size(), who, "kernel_size");
  check_positive(options.stride(), who, "stride");
  auto conv = [&](int64_t out) {
    return torch::nn::Conv2d(
        torch::nn::Conv2dOptions(options.in_channels(), out, options.kernel_size()).stride(options.stride()));
  };
  pose = register_module("pose", conv(options.capsule_types() * kPoseSize));
  activation = register_module("activation", conv(options.capsule_types()));
}

MatrixCaps PrimaryMatrixCapsImpl::forward(const torch::Tensor& x) {
  if (!x.defined() || x.dim() != 4 || x.size(1) != options.in_channels())
    throw std::invalid_argument(fmt::format("PrimaryMatrixCaps: x must be [N, {}, H, W], got {}",
                                            options.in_channels(),
                                            shape(x)));
  const auto T = options.capsule_types();
  auto p = pose->forward(x);  // [N, T * 16, H', W'], channel = type * 16 + element
  const auto N = p.size(0), H = p.size(2), W = p.size(3);
  // Pose elements must go last before any flattening (a plain view would mix positions).
  auto poses = p.view({N, T, kPoseSize, H, W}).permute({0, 3, 4, 1, 2}).contiguous();  // [N, H', W', T, 16]
  auto acts = torch::sigmoid(activation->forward(x)).permute({0, 2, 3, 1}).contiguous();  // [N, H', W', T]
  return {poses, acts};
}

// --- ConvMatrixCaps ------------------------------------------------------------------------------

ConvMatrixCapsImpl::ConvMatrixCapsImpl(const ConvMatrixCapsOptions& options_) : options(options_) { reset(); }

void ConvMatrixCapsImpl::reset() {
  const char* who = "ConvMatrixCaps";
  check_positive(options.in_types(), who, "in_types");
  check_positive(options.out_types(), who, "out_types");
  check_positive(options.kernel_size(), who, "kernel_size");
  check_positive(options.stride(), who, "stride");
  check_positive(options.routing().iterations, who, "routing.iterations");
  const auto K = options.kernel_size();
  weight = register_parameter("weight", init_transforms({K * K * options.in_types(), options.out_types()}));
  beta_u = register_parameter("beta_u", torch::zeros({options.out_types()}));
  beta_a = register_parameter("beta_a", torch::zeros({options.out_types()}));
}

std::pair<torch::Tensor, torch::Tensor> ConvMatrixCapsImpl::votes(const MatrixCaps& in) const {
  check_matrix_caps(in, options.in_types(), "ConvMatrixCaps");
  const auto K = options.kernel_size(), s = options.stride();
  const auto N = in.poses.size(0), H = in.poses.size(1), W = in.poses.size(2), Bin = in.poses.size(3);
  if (H < K || W < K)
    throw std::invalid_argument(
        fmt::format("ConvMatrixCaps: the {}x{} capsule grid is smaller than kernel_size {}", H, W, K));
  const auto Ho = (H - K) / s + 1, Wo = (W - K) / s + 1;
  // Windows by strided slicing, one slice per kernel offset: K*K cheap views, then one stack.
  std::vector<torch::Tensor> pose_patches, act_patches;
  for (int64_t ky = 0; ky < K; ++ky)
    for (int64_t kx = 0; kx < K; ++kx) {
      pose_patches.push_back(
          in.poses.slice(1, ky, ky + s * (Ho - 1) + 1, s).slice(2, kx, kx + s * (Wo - 1) + 1, s));  // [N, Ho, Wo, Bin, 16]
      act_patches.push_back(
          in.activations.slice(1, ky, ky + s * (Ho - 1) + 1, s).slice(2, kx, kx + s * (Wo - 1) + 1, s));
    }
  const auto I = K * K * Bin;
  auto M = torch::stack(pose_patches, 3).reshape({N, Ho, Wo, I, 1, kPoseSide, kPoseSide});  // [N, Ho, Wo, I, 1, 4, 4]
  auto a = torch::stack(act_patches, 3).reshape({N * Ho * Wo, I});                         // [N*Ho*Wo, I]
  auto V = torch::matmul(M, weight);  // [N, Ho, Wo, I, C, 4, 4]
  return {V.reshape({N * Ho * Wo, I, options.out_types(), kPoseSize}), a};
}

MatrixCaps ConvMatrixCapsImpl::forward(const MatrixCaps& in) {
  auto [V, a] = votes(in);
  const auto K = options.kernel_size(), s = options.stride();
  const auto N = in.poses.size(0), Ho = (in.poses.size(1) - K) / s + 1, Wo = (in.poses.size(2) - K) / s + 1;
  const auto C = options.out_types();
  auto r = em_routing(V, a, beta_u, beta_a, options.routing());  // mu: [N*Ho*Wo, C, 16], a: [N*Ho*Wo, C]
  return {r.poses.view({N, Ho, Wo, C, kPoseSize}), r.activations.view({N, Ho, Wo, C})};
}

// --- ClassMatrixCaps -----------------------------------------------------------------------------

ClassMatrixCapsImpl::ClassMatrixCapsImpl(const ClassMatrixCapsOptions& options_) : options(options_) { reset(); }

void ClassMatrixCapsImpl::reset() {
  const char* who = "ClassMatrixCaps";
  check_positive(options.in_types(), who, "in_types");
  check_positive(options.num_classes(), who, "num_classes");
  check_positive(options.routing().iterations, who, "routing.iterations");
  weight = register_parameter("weight", init_transforms({options.in_types(), options.num_classes()}));
  beta_u = register_parameter("beta_u", torch::zeros({options.num_classes()}));
  beta_a = register_parameter("beta_a", torch::zeros({options.num_classes()}));
}

std::pair<torch::Tensor, torch::Tensor> ClassMatrixCapsImpl::votes(const MatrixCaps& in) const {
  check_matrix_caps(in, options.in_types(), "ClassMatrixCaps");
  const auto N = in.poses.size(0), H = in.poses.size(1), W = in.poses.size(2), Bin = in.poses.size(3);
  const auto C = options.num_classes();
  auto M = in.poses.reshape({N, H, W, Bin, 1, kPoseSide, kPoseSide});
  auto V = torch::matmul(M, weight);  // [N, H, W, Bin, C, 4, 4]
  if (options.coordinate_addition()) {
    auto coords = torch::zeros({H, W, 1, 1, kPoseSide, kPoseSide}, V.options());
    auto rows = (torch::arange(H, V.options()) + 0.5) / double(H);  // [H]
    auto cols = (torch::arange(W, V.options()) + 0.5) / double(W);  // [W]
    coords.select(4, 0).select(4, 3).copy_(rows.view({H, 1, 1, 1}).expand({H, W, 1, 1}));
    coords.select(4, 1).select(4, 3).copy_(cols.view({1, W, 1, 1}).expand({H, W, 1, 1}));
    V = V + coords;
  }
  return {V.reshape({N, H * W * Bin, C, kPoseSize}), in.activations.reshape({N, H * W * Bin})};
}

EmRoutingResult ClassMatrixCapsImpl::forward(const MatrixCaps& in) {
  auto [V, a] = votes(in);
  return em_routing(V, a, beta_u, beta_a, options.routing());  // mu: [N, C, 16], a: [N, C]
}

}  // namespace capsnet::nn
