#include "capsnet/nn/matrix_caps.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "capsnet/kernels/conv_dispatch.h"

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

// Votes V[p, i, c] = M[p, i] W[i, c] (4x4 matrix products) for P positions sharing the weights.
// poses: [P, I, 4, 4], weight: [I, C, 4, 4] -> [P, I, C, 4, 4].
// einsum runs this as I GEMMs [P*4, 4] x [4, C*4] (batched over i), where torch::matmul's broadcast
// expanded the weight to every position and ran P*I*C separate 4x4 products: 3x faster forward +
// backward for the default ConvCaps1 (P = 32*25, I = 72, C = 8), 1.7x for the paper's small model
// (docs/em.md, "Speed").
torch::Tensor transform_poses(const torch::Tensor& poses, const torch::Tensor& weight) {
  return torch::einsum("pirk,ickd->picrd", {poses, weight});
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

MatrixCaps PrimaryMatrixCapsImpl::forward(const torch::Tensor& x, Precision precision) {
  if (!x.defined() || x.dim() != 4 || x.size(1) != options.in_channels())
    throw std::invalid_argument(fmt::format("PrimaryMatrixCaps: x must be [N, {}, H, W], got {}",
                                            options.in_channels(),
                                            shape(x)));
  const auto T = options.capsule_types();
  // Only the convolutions may run in bf16: their outputs go back to the master dtype at once.
  const auto master = pose->weight.scalar_type();
  auto p = kernels::conv2d_at(pose, x, precision).to(master);  // [N, T * 16, H', W'], channel = type * 16 + element
  const auto N = p.size(0), H = p.size(2), W = p.size(3);
  // Pose elements must go last before any flattening (a plain view would mix positions).
  auto poses = p.view({N, T, kPoseSize, H, W}).permute({0, 3, 4, 1, 2}).contiguous();  // [N, H', W', T, 16]
  auto a = torch::sigmoid(kernels::conv2d_at(activation, x, precision).to(master));  // [N, T, H', W']
  auto acts = a.permute({0, 2, 3, 1}).contiguous();                            // [N, H', W', T]
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
  auto M = torch::stack(pose_patches, 3).reshape({N * Ho * Wo, I, kPoseSide, kPoseSide});  // [N*Ho*Wo, I, 4, 4]
  auto a = torch::stack(act_patches, 3).reshape({N * Ho * Wo, I});                      // [N*Ho*Wo, I]
  auto V = transform_poses(M, weight);  // [N*Ho*Wo, I, C, 4, 4]
  return {V.reshape({N * Ho * Wo, I, options.out_types(), kPoseSize}), a};
}

WindowGeometry ConvMatrixCapsImpl::geometry(const MatrixCaps& in) const {
  check_matrix_caps(in, options.in_types(), "ConvMatrixCaps");
  WindowGeometry g;
  g.batch = in.poses.size(0);
  g.height = in.poses.size(1);
  g.width = in.poses.size(2);
  g.in_types = in.poses.size(3);
  g.kernel = options.kernel_size();
  g.stride = options.stride();
  return g;
}

EmRoutingOptions ConvMatrixCapsImpl::routing_options(const MatrixCaps& in) const {
  auto routing = options.routing();
  if (options.cross_window()) {
    const auto g = geometry(in);
    routing.child_log_total = [g](const torch::Tensor& log_weights) {
      return cross_window_child_log_total(log_weights, g);
    };
  }
  return routing;
}

MatrixCaps ConvMatrixCapsImpl::forward(const MatrixCaps& in) {
  auto [V, a] = votes(in);
  const auto g = geometry(in);
  const auto N = g.batch, Ho = g.out_height(), Wo = g.out_width(), C = options.out_types();
  auto r = em_routing(V, a, beta_u, beta_a, routing_options(in));  // mu: [N*Ho*Wo, C, 16], a: [N*Ho*Wo, C]
  return {r.poses.view({N, Ho, Wo, C, kPoseSize}), r.activations.view({N, Ho, Wo, C})};
}

// --- Cross-window normalisation ------------------------------------------------------------------

torch::Tensor cross_window_child_log_total(const torch::Tensor& log_weights, const WindowGeometry& g) {
  namespace F = torch::nn::functional;
  const auto N = g.batch, H = g.height, W = g.width, Bin = g.in_types, K = g.kernel, s = g.stride;
  const auto Ho = g.out_height(), Wo = g.out_width(), L = Ho * Wo, I = K * K * Bin;
  if (!log_weights.defined() || log_weights.dim() != 3 || log_weights.size(0) != N * L || log_weights.size(1) != I)
    throw std::invalid_argument(fmt::format("cross_window_child_log_total: log_weights must be [{}, {}, C], got {}",
                                            N * L, I, shape(log_weights)));
  // Per (window, child): log sum_c a_c p_c over the window's C parents.
  const auto lse = torch::logsumexp(log_weights, 2);  // [N*Ho*Wo, I]
  // fold/unfold layout: [N, Bin*K*K, Ho*Wo] (channel-major, kernel offsets inside); ours is
  // [N*Ho*Wo, K*K*Bin]. Swapping dims 1 and 4 of [N, ., K, K, .] converts either way.
  const auto to_cols = [&](const torch::Tensor& t) {
    return t.reshape({N, L, K, K, Bin}).permute({0, 4, 2, 3, 1}).reshape({N, Bin * K * K, L});
  };
  const auto from_cols = [&](const torch::Tensor& t) {
    return t.reshape({N, Bin, K, K, L}).permute({0, 4, 2, 3, 1}).reshape({N * L, I});
  };
  // Per-child shift m = max over the windows containing it, so that every exp below is <= 1 and one is
  // exactly 1. Detached: log sum exp(x - m) + m does not depend on m, so its gradient through m is 0.
  torch::Tensor shift;  // [N*Ho*Wo, I]
  {
    torch::NoGradGuard no_grad;
    auto grid = torch::full({N, H, W, Bin}, -std::numeric_limits<double>::infinity(), lse.options());
    const auto per_window = lse.detach().reshape({N, Ho, Wo, K, K, Bin});
    std::vector<torch::Tensor> back;
    for (int64_t ky = 0; ky < K; ++ky)
      for (int64_t kx = 0; kx < K; ++kx) {
        auto cells = grid.slice(1, ky, ky + s * (Ho - 1) + 1, s).slice(2, kx, kx + s * (Wo - 1) + 1, s);  // [N, Ho, Wo, Bin]
        cells.copy_(torch::maximum(cells, per_window.select(3, ky).select(3, kx)));
      }
    for (int64_t ky = 0; ky < K; ++ky)
      for (int64_t kx = 0; kx < K; ++kx)
        back.push_back(grid.slice(1, ky, ky + s * (Ho - 1) + 1, s).slice(2, kx, kx + s * (Wo - 1) + 1, s));
    shift = torch::stack(back, 3).reshape({N * L, I});  // [N, Ho, Wo, K*K, Bin] -> [N*Ho*Wo, I]
  }
  // Sum over all windows containing each child: fold adds every (window, offset) entry into its cell.
  const auto total = F::fold(to_cols(torch::exp(lse - shift)),
                             F::FoldFuncOptions({H, W}, {K, K}).stride(s));  // [N, Bin, H, W]
  // Cells no window covers hold 0 and are never read back; log(0)'s gradient there would be 0/0.
  const auto log_total = torch::log(torch::where(total > 0, total, torch::ones_like(total)));
  const auto per_entry = from_cols(F::unfold(log_total, F::UnfoldFuncOptions({K, K}).stride(s)));  // [N*Ho*Wo, I]
  return (per_entry + shift).unsqueeze(2);  // [N*Ho*Wo, I, 1]
}

// --- Reference -----------------------------------------------------------------------------------

namespace detail {

EmRoutingResult reference_conv_em_routing(const torch::Tensor& votes, const torch::Tensor& activations,
                                          const torch::Tensor& beta_u_in, const torch::Tensor& beta_a_in,
                                          const EmRoutingOptions& options, const WindowGeometry& g,
                                          bool cross_window) {
  auto plain = options;
  plain.child_log_total = nullptr;
  capsnet::detail::check_em_routing_args(votes, activations, beta_u_in, beta_a_in, plain);
  const auto N = g.batch, H = g.height, W = g.width, Bin = g.in_types, K = g.kernel, s = g.stride;
  const auto Ho = g.out_height(), Wo = g.out_width();
  const auto C = votes.size(2), D = votes.size(3);
  if (votes.size(0) != N * Ho * Wo || votes.size(1) != K * K * Bin)
    throw std::invalid_argument("reference_conv_em_routing: votes do not fit the geometry");
  const auto beta_u = beta_u_in.numel() == 1 ? beta_u_in.reshape({1}).expand({C}) : beta_u_in.reshape({C});
  const auto beta_a = beta_a_in.numel() == 1 ? beta_a_in.reshape({1}).expand({C}) : beta_a_in.reshape({C});
  const double mass_scale = options.normalize_cost ? double(C) / double(K * K * Bin) : 1.0;
  const auto zero = torch::zeros({}, votes.options());
  const int64_t windows = N * Ho * Wo, I = K * K * Bin;
  using Row = std::vector<torch::Tensor>;

  // The global child (n, y, x, b) seen as child i of window w, and the parents it votes for.
  auto global_child = [&](int64_t w, int64_t i) {
    const int64_t n = w / (Ho * Wo), oy = (w / Wo) % Ho, ox = w % Wo;
    const int64_t ky = i / (K * Bin), kx = (i / Bin) % K, b = i % Bin;
    return ((n * H + oy * s + ky) * W + ox * s + kx) * Bin + b;
  };
  std::vector<int64_t> parents_of(static_cast<size_t>(N * H * W * Bin), 0);  // |parents of g| = windows(g) * C
  for (int64_t w = 0; w < windows; ++w)
    for (int64_t i = 0; i < I; ++i) parents_of[static_cast<size_t>(global_child(w, i))] += C;

  // R[w][i][c]: the share of child i of window w's vote that goes to parent c of window w. Procedure 1
  // starts with R uniform over all the child's parents.
  std::vector<std::vector<Row>> R(windows, std::vector<Row>(I, Row(C)));
  for (int64_t w = 0; w < windows; ++w)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t c = 0; c < C; ++c) {
        const double n_parents = cross_window ? double(parents_of[static_cast<size_t>(global_child(w, i))]) : double(C);
        R[w][i][c] = torch::full({}, 1.0 / n_parents, votes.options());
      }
  std::vector<std::vector<Row>> mu(windows, std::vector<Row>(C, Row(D))), var = mu;
  std::vector<Row> a_out(windows, Row(C));
  for (int64_t t = 0; t < options.iterations; ++t) {
    const double lambda = capsnet::detail::inverse_temperature_at(options, t);
    // M-step: each parent sees the children of its own window.
    for (int64_t w = 0; w < windows; ++w) {
      Row cost(C, zero);
      for (int64_t c = 0; c < C; ++c) {
        Row Ra(I);
        auto sum_R = zero;
        for (int64_t i = 0; i < I; ++i) {
          Ra[i] = R[w][i][c] * activations[w][i];
          sum_R = sum_R + Ra[i];
        }
        for (int64_t h = 0; h < D; ++h) {
          auto num = zero;
          for (int64_t i = 0; i < I; ++i) num = num + Ra[i] * votes[w][i][c][h];
          mu[w][c][h] = num / (sum_R + options.mass_eps);
          auto sq = zero;
          for (int64_t i = 0; i < I; ++i) sq = sq + Ra[i] * (votes[w][i][c][h] - mu[w][c][h]).pow(2);
          var[w][c][h] = sq / (sum_R + options.mass_eps) + options.variance_eps;
          cost[c] = cost[c] + (beta_u[c] + 0.5 * torch::log(var[w][c][h])) * sum_R * mass_scale;
        }
      }
      if (options.standardize_cost) cost = capsnet::detail::reference_standardize(cost, options.cost_std_eps);
      for (int64_t c = 0; c < C; ++c)
        a_out[w][c] = options.logit_offset_outside_lambda ? torch::sigmoid(beta_a[c] - lambda * cost[c])
                                                          : torch::sigmoid(lambda * (beta_a[c] - cost[c]));
    }
    if (t == options.iterations - 1) break;
    // E-step: a_c p_c for every (window, child, parent), then divide by the child's total over every
    // parent it votes for (all windows containing it, or only this one without cross_window).
    std::vector<std::vector<Row>> ap(windows, std::vector<Row>(I, Row(C)));
    std::vector<torch::Tensor> total(parents_of.size(), zero);
    for (int64_t w = 0; w < windows; ++w)
      for (int64_t i = 0; i < I; ++i)
        for (int64_t c = 0; c < C; ++c) {
          auto exponent = zero;
          auto norm = torch::ones({}, votes.options());
          for (int64_t h = 0; h < D; ++h) {
            exponent = exponent - (votes[w][i][c][h] - mu[w][c][h]).pow(2) / (2 * var[w][c][h]);
            norm = norm * (2 * M_PI * var[w][c][h]);
          }
          ap[w][i][c] = a_out[w][c] * torch::exp(exponent) / torch::sqrt(norm);
          total[static_cast<size_t>(global_child(w, i))] = total[static_cast<size_t>(global_child(w, i))] + ap[w][i][c];
        }
    for (int64_t w = 0; w < windows; ++w)
      for (int64_t i = 0; i < I; ++i) {
        auto window_total = zero;
        for (int64_t c = 0; c < C; ++c) window_total = window_total + ap[w][i][c];
        const auto& denominator = cross_window ? total[static_cast<size_t>(global_child(w, i))] : window_total;
        for (int64_t c = 0; c < C; ++c) R[w][i][c] = ap[w][i][c] / denominator;
      }
  }
  Row poses_w, acts_w;
  for (int64_t w = 0; w < windows; ++w) {
    Row rows;
    for (int64_t c = 0; c < C; ++c) rows.push_back(torch::stack(mu[w][c]));
    poses_w.push_back(torch::stack(rows));    // [C, D]
    acts_w.push_back(torch::stack(a_out[w]));  // [C]
  }
  return {torch::stack(poses_w), torch::stack(acts_w)};
}

}  // namespace detail

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
  auto M = in.poses.reshape({N * H * W, Bin, kPoseSide, kPoseSide});
  auto V = transform_poses(M, weight).reshape({N, H, W, Bin, C, kPoseSide, kPoseSide});
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
