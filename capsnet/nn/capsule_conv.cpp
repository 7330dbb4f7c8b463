#include "capsnet/nn/capsule_conv.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/ops/routing.h"

namespace capsnet::nn {
namespace {

std::string shape_string(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t k = 0; k < sizes.size(); ++k) s += (k ? ", " : "") + std::to_string(sizes[k]);
  return s + "]";
}

struct LayerShape {
  int64_t in_types, in_atoms, out_types, out_atoms, kernel;
};

void check_options(const char* layer, const LayerShape& s, const detail::CapsuleConvGeometry& g,
                   const RoutingOptions& routing) {
  auto positive = [&](const char* name, int64_t v) {
    if (v <= 0) throw std::invalid_argument(fmt::format("{}: {} must be positive, got {}", layer, name, v));
  };
  positive("in_types", s.in_types);
  positive("in_atoms", s.in_atoms);
  positive("out_types", s.out_types);
  positive("out_atoms", s.out_atoms);
  positive("kernel_size", s.kernel);
  positive("stride", g.stride);
  if (g.padding < 0) throw std::invalid_argument(fmt::format("{}: padding must be >= 0, got {}", layer, g.padding));
  if (g.output_padding < 0 || (g.output_padding > 0 && g.output_padding >= g.stride))
    throw std::invalid_argument(
        fmt::format("{}: output_padding must be in [0, stride) = [0, {}), got {}", layer, g.stride, g.output_padding));
  try {
    routing.validate();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}: {}", layer, e.what()));
  }
}

void check_capsules(const char* layer, const torch::Tensor& u, const LayerShape& s,
                    const detail::CapsuleConvGeometry& g) {
  if (!u.defined()) throw std::invalid_argument(fmt::format("{}: input u is undefined", layer));
  if (u.dim() != 5)
    throw std::invalid_argument(fmt::format("{}: input u must be [B, T_in={}, A_in={}, H, W] (5 dims), got {}", layer,
                                            s.in_types, s.in_atoms, shape_string(u.sizes())));
  if (u.size(1) != s.in_types)
    throw std::invalid_argument(fmt::format("{}: input u has {} capsule types (dim 1), the layer expects T_in = {}",
                                            layer, u.size(1), s.in_types));
  if (u.size(2) != s.in_atoms)
    throw std::invalid_argument(fmt::format("{}: input u has {} atoms per capsule (dim 2), the layer expects A_in = {}",
                                            layer, u.size(2), s.in_atoms));
  if (!u.is_floating_point())
    throw std::invalid_argument(fmt::format("{}: input u must be floating point, got {}", layer,
                                            std::string(c10::toString(u.scalar_type()))));
  const int64_t h = detail::capsule_conv_output_size(u.size(3), s.kernel, g);
  const int64_t w = detail::capsule_conv_output_size(u.size(4), s.kernel, g);
  if (h <= 0 || w <= 0 || (!g.transposed && (u.size(3) + 2 * g.padding < s.kernel || u.size(4) + 2 * g.padding < s.kernel)))
    throw std::invalid_argument(fmt::format("{}: input u {} is too small for kernel_size {} with padding {}", layer,
                                            shape_string(u.sizes()), s.kernel, g.padding));
}

torch::Tensor init_weight(int64_t groups, const LayerShape& s, double std) {
  if (std <= 0) std = 1.0 / std::sqrt(static_cast<double>(s.in_atoms * s.kernel * s.kernel));
  return torch::randn({groups, s.out_types, s.out_atoms, s.in_atoms, s.kernel, s.kernel}) * std;
}

// u: [B, T_in, A_in, H, W]; weight: [G, T_out, A_out, A_in, k, k] -> u_hat: [B, T_in, T_out, A_out, H', W'].
torch::Tensor fast_predictions(const torch::Tensor& u, const torch::Tensor& weight, const torch::Tensor& bias,
                               const detail::CapsuleConvGeometry& g, Precision precision) {
  const int64_t B = u.size(0), T_in = u.size(1), A_in = u.size(2), H = u.size(3), W = u.size(4);
  const int64_t G = weight.size(0), T_out = weight.size(1), A_out = weight.size(2), k = weight.size(4);
  const bool per_type = G == T_in && G > 1;
  // Per-type weights are one grouped convolution over the T_in * A_in channels; shared weights fold the
  // child types into the batch instead.
  auto x = per_type ? u.reshape({B, T_in * A_in, H, W}) : u.reshape({B * T_in, A_in, H, W});
  const int64_t groups = per_type ? G : 1;
  torch::Tensor y;  // [B, T_in * T_out * A_out, H', W'] or [B * T_in, T_out * A_out, H', W'], master dtype
  if (!g.transposed) {
    auto w = weight.reshape({groups * T_out * A_out, A_in, k, k});
    if (precision == Precision::kFloat32) {
      y = torch::conv2d(x, w, {}, g.stride, g.padding, /*dilation=*/1, groups);
    } else {
      // Only the convolution runs in bf16, on copies cast per call from the fp32 master weights (autograd
      // returns fp32 gradients through the casts); its output goes back before the bias and the routing.
      const auto dtype = compute_dtype(precision);
      y = torch::conv2d(x.to(dtype), w.to(dtype), {}, g.stride, g.padding, /*dilation=*/1, groups)
              .to(weight.scalar_type());
    }
  } else {
    // conv_transpose2d wants [in_channels, out_channels / groups, k, k].
    auto w = weight.permute({0, 3, 1, 2, 4, 5}).reshape({groups * A_in, T_out * A_out, k, k});
    y = kernels::conv_transpose2d_at(x, w, {}, g.stride, g.padding, g.output_padding, groups, precision);
  }
  auto u_hat = y.view({B, T_in, T_out, A_out, y.size(2), y.size(3)});
  if (bias.defined()) u_hat = u_hat + bias.view({1, 1, T_out, A_out, 1, 1});
  return u_hat;
}

}  // namespace

torch::Tensor local_routing(const torch::Tensor& u_hat, const RoutingOptions& routing) {
  if (!u_hat.defined() || u_hat.dim() != 6)
    throw std::invalid_argument("local_routing: u_hat must be [B, T_in, T_out, A_out, H, W] (6 dims), got " +
                                (u_hat.defined() ? shape_string(u_hat.sizes()) : std::string("undefined")));
  const int64_t B = u_hat.size(0), T_in = u_hat.size(1), T_out = u_hat.size(2), A_out = u_hat.size(3),
                H = u_hat.size(4), W = u_hat.size(5);
  // Every output position is an independent routing problem: positions go into the batch.
  auto per_position = u_hat.permute({0, 4, 5, 1, 2, 3}).reshape({B * H * W, T_in, T_out, A_out});
  torch::Tensor v;  // [B * H * W, T_out, A_out]
  if (routing.fused && u_hat.is_cpu() &&
      (u_hat.scalar_type() == torch::kFloat || u_hat.scalar_type() == torch::kDouble)) {
    v = ops::routing_from_predictions(per_position, routing.iterations, routing.grad_through_routing);
  } else {
    v = dynamic_routing(per_position, routing);
  }
  return v.view({B, H, W, T_out, A_out}).permute({0, 3, 4, 1, 2}).contiguous();  // [B, T_out, A_out, H, W]
}

namespace detail {

int64_t capsule_conv_output_size(int64_t n, int64_t kernel, const CapsuleConvGeometry& g) {
  if (g.transposed) return (n - 1) * g.stride - 2 * g.padding + kernel + g.output_padding;
  const int64_t span = n + 2 * g.padding - kernel;
  return span < 0 ? 0 : span / g.stride + 1;
}

torch::Tensor reference_capsule_predictions(const torch::Tensor& u, const torch::Tensor& weight,
                                            const torch::Tensor& bias, const CapsuleConvGeometry& g) {
  TORCH_CHECK(u.dim() == 5 && weight.dim() == 6 && weight.size(3) == u.size(2) &&
                  (weight.size(0) == u.size(1) || weight.size(0) == 1) && weight.size(4) == weight.size(5),
              "reference_capsule_predictions: u ", u.sizes(), " and weight ", weight.sizes(), " do not match");
  const int64_t B = u.size(0), T_in = u.size(1), H = u.size(3), W = u.size(4);
  const int64_t T_out = weight.size(1), A_out = weight.size(2), A_in = weight.size(3), k = weight.size(4);
  const int64_t Ho = capsule_conv_output_size(H, k, g), Wo = capsule_conv_output_size(W, k, g);
  TORCH_CHECK(Ho > 0 && Wo > 0, "reference_capsule_predictions: empty output");
  // w: [G, T_out * A_out, A_in, k, k]; a product with one input vector per child type:
  // (w[:, :, :, dy, dx] [1|T_in, TA, A_in] * x [B, T_in, 1, A_in]).sum(-1) -> [B, T_in, TA].
  auto w = weight.reshape({weight.size(0), T_out * A_out, A_in, k, k});
  auto apply = [&](int64_t dy, int64_t dx, int64_t iy, int64_t ix) {
    auto x = u.select(4, ix).select(3, iy);          // [B, T_in, A_in]
    auto m = w.select(4, dx).select(3, dy);          // [G, TA, A_in]
    return (m.unsqueeze(0) * x.unsqueeze(2)).sum(-1);  // [B, T_in, TA]
  };
  std::vector<torch::Tensor> out(static_cast<size_t>(Ho * Wo));  // per output position: [B, T_in, TA]
  for (auto& o : out) o = torch::zeros({B, T_in, T_out * A_out}, u.options());
  if (!g.transposed) {
    for (int64_t oy = 0; oy < Ho; ++oy)
      for (int64_t ox = 0; ox < Wo; ++ox)
        for (int64_t dy = 0; dy < k; ++dy)
          for (int64_t dx = 0; dx < k; ++dx) {
            const int64_t iy = oy * g.stride - g.padding + dy, ix = ox * g.stride - g.padding + dx;
            if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;  // zero padding
            auto& o = out[static_cast<size_t>(oy * Wo + ox)];
            o = o + apply(dy, dx, iy, ix);
          }
  } else {
    for (int64_t iy = 0; iy < H; ++iy)
      for (int64_t ix = 0; ix < W; ++ix)
        for (int64_t dy = 0; dy < k; ++dy)
          for (int64_t dx = 0; dx < k; ++dx) {
            const int64_t oy = iy * g.stride - g.padding + dy, ox = ix * g.stride - g.padding + dx;
            if (oy < 0 || oy >= Ho || ox < 0 || ox >= Wo) continue;  // cropped by padding
            auto& o = out[static_cast<size_t>(oy * Wo + ox)];
            o = o + apply(dy, dx, iy, ix);
          }
  }
  auto u_hat = torch::stack(out, -1).view({B, T_in, T_out, A_out, Ho, Wo});
  if (bias.defined()) u_hat = u_hat + bias.view({1, 1, T_out, A_out, 1, 1});
  return u_hat;
}

torch::Tensor reference_capsule_conv(const torch::Tensor& u, const torch::Tensor& weight, const torch::Tensor& bias,
                                     const CapsuleConvGeometry& g, const RoutingOptions& routing) {
  auto u_hat = reference_capsule_predictions(u, weight, bias, g);  // [B, T_in, T_out, A_out, H', W']
  const int64_t Ho = u_hat.size(4), Wo = u_hat.size(5);
  std::vector<torch::Tensor> v;  // per position: [B, T_out, A_out]
  for (int64_t y = 0; y < Ho; ++y)
    for (int64_t x = 0; x < Wo; ++x) v.push_back(capsnet::detail::reference_routing(u_hat.select(5, x).select(4, y), routing));
  return torch::stack(v, -1).view({u.size(0), weight.size(1), weight.size(2), Ho, Wo});
}

}  // namespace detail

// ---- CapsuleConv2d -------------------------------------------------------------------------------

CapsuleConv2dImpl::CapsuleConv2dImpl(const CapsuleConv2dOptions& options_) : options(options_) { reset(); }

detail::CapsuleConvGeometry CapsuleConv2dImpl::geometry() const {
  return {options.stride(), options.padding(), 0, false};
}

void CapsuleConv2dImpl::reset() {
  const LayerShape s{options.in_types(), options.in_atoms(), options.out_types(), options.out_atoms(),
                     options.kernel_size()};
  check_options("CapsuleConv2d", s, geometry(), options.routing());
  weight = register_parameter("weight",
                              init_weight(options.share_across_types() ? 1 : s.in_types, s, options.weight_std()));
  bias = options.bias() ? register_parameter("bias", torch::zeros({s.out_types, s.out_atoms})) : torch::Tensor();
}

void CapsuleConv2dImpl::check_input(const torch::Tensor& u) const {
  check_capsules("CapsuleConv2d",
                 u,
                 {options.in_types(), options.in_atoms(), options.out_types(), options.out_atoms(), options.kernel_size()},
                 geometry());
}

torch::Tensor CapsuleConv2dImpl::predictions(const torch::Tensor& u, Precision precision) {
  check_input(u);
  return fast_predictions(u, weight, bias, geometry(), precision);
}

torch::Tensor CapsuleConv2dImpl::forward(const torch::Tensor& u, Precision precision) {
  return local_routing(predictions(u, precision), options.routing());
}

// ---- CapsuleConvTranspose2d ----------------------------------------------------------------------

CapsuleConvTranspose2dImpl::CapsuleConvTranspose2dImpl(const CapsuleConvTranspose2dOptions& options_)
    : options(options_) {
  reset();
}

detail::CapsuleConvGeometry CapsuleConvTranspose2dImpl::geometry() const {
  return {options.stride(), options.padding(), options.output_padding(), true};
}

void CapsuleConvTranspose2dImpl::reset() {
  const LayerShape s{options.in_types(), options.in_atoms(), options.out_types(), options.out_atoms(),
                     options.kernel_size()};
  check_options("CapsuleConvTranspose2d", s, geometry(), options.routing());
  weight = register_parameter("weight",
                              init_weight(options.share_across_types() ? 1 : s.in_types, s, options.weight_std()));
  bias = options.bias() ? register_parameter("bias", torch::zeros({s.out_types, s.out_atoms})) : torch::Tensor();
}

void CapsuleConvTranspose2dImpl::check_input(const torch::Tensor& u) const {
  check_capsules("CapsuleConvTranspose2d",
                 u,
                 {options.in_types(), options.in_atoms(), options.out_types(), options.out_atoms(), options.kernel_size()},
                 geometry());
}

torch::Tensor CapsuleConvTranspose2dImpl::predictions(const torch::Tensor& u, Precision precision) {
  check_input(u);
  return fast_predictions(u, weight, bias, geometry(), precision);
}

torch::Tensor CapsuleConvTranspose2dImpl::forward(const torch::Tensor& u, Precision precision) {
  return local_routing(predictions(u, precision), options.routing());
}

}  // namespace capsnet::nn
