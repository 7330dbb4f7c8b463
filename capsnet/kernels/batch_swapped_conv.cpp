#include "capsnet/kernels/batch_swapped_conv.h"

#include "capsnet/kernels/saved_pairs.h"

#include <algorithm>

namespace capsnet::kernels {
namespace {

using detail::as_array;
using detail::as_vector;

class Conv2dFunction : public torch::autograd::Function<Conv2dFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, const Conv2dGeometry& g, ConvGradientPaths paths) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stride"] = as_vector(g.stride);
    ctx->saved_data["padding"] = as_vector(g.padding);
    ctx->saved_data["dilation"] = as_vector(g.dilation);
    ctx->saved_data["weight_batch_swapped"] = paths.weight_batch_swapped;
    ctx->saved_data["input_by_phases"] = paths.input_by_phases;
    return at::conv2d(x, w, b, as_vector(g.stride), as_vector(g.padding), as_vector(g.dilation));
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    // create_graph: the gradient would be built from kernels autograd cannot see through, so
    // differentiating it again would be silently wrong. Refused, as the registered ops refuse it.
    TORCH_CHECK(!torch::GradMode::is_enabled(), "conv2d_with_gradient_paths: double backward (create_graph, "
                "differentiating the gradient) is not implemented");
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    const Conv2dGeometry g{as_array(ctx->saved_data["stride"]), as_array(ctx->saved_data["padding"]),
                           as_array(ctx->saved_data["dilation"])};
    const auto dy = grads[0].contiguous();  // dy: [N, O, P, Q]
    torch::Tensor dx, dw, db;
    // The weight gradient first: its transients (x transposed, and oneDNN's blocked copy of that) are
    // freed before dx, the size of x, is allocated, so the two never coexist (peak memory, docs/kernels.md).
    if (ctx->needs_input_grad(1))
      dw = ctx->saved_data["weight_batch_swapped"].toBool()
               ? conv2d_weight_grad_batch_swapped(dy, x, {w.size(2), w.size(3)}, g)
               : conv2d_weight_grad_reference(dy, x, w, g);
    if (ctx->needs_input_grad(0))
      dx = ctx->saved_data["input_by_phases"].toBool()
               ? conv2d_input_grad_by_phases(dy, w, {x.size(2), x.size(3)}, g)
               : conv2d_input_grad_reference(dy, w, {x.size(2), x.size(3)}, g);
    if (ctx->needs_input_grad(2)) db = dy.sum({0, 2, 3});
    return {dx, dw, db, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor conv2d_weight_grad_batch_swapped(const torch::Tensor& dy, const torch::Tensor& x,
                                               std::array<int64_t, 2> kernel, const Conv2dGeometry& g,
                                               int64_t chunk_bytes) {
  TORCH_CHECK(dy.dim() == 4 && x.dim() == 4 && dy.size(0) == x.size(0),
              "conv2d_weight_grad_batch_swapped: dy [N, O, P, Q] and x [N, C, H, W] must share N");
  // The forward read padded rows [0, s*(P-1) + d*(K-1) + 1): pad explicitly, then crop to exactly those
  // rows and columns, so the swapped convolution yields K x K outputs (no extra row to compute and drop).
  auto xp = x;
  if (g.padding[0] > 0 || g.padding[1] > 0)
    xp = at::constant_pad_nd(x, {g.padding[1], g.padding[1], g.padding[0], g.padding[0]});
  const int64_t rows = g.stride[0] * (dy.size(2) - 1) + g.dilation[0] * (kernel[0] - 1) + 1;
  const int64_t cols = g.stride[1] * (dy.size(3) - 1) + g.dilation[1] * (kernel[1] - 1) + 1;
  TORCH_CHECK(rows <= xp.size(2) && cols <= xp.size(3),
              "conv2d_weight_grad_batch_swapped: dy's spatial size does not fit x's");
  const auto window = xp.slice(2, 0, rows).slice(3, 0, cols);  // [N, C, rows, cols]
  const auto dyt = dy.transpose(0, 1).contiguous();            // dyt: [O, N, P, Q]
  // The input channels are the swapped convolution's batch, so they go through it in chunks: x's
  // transposed copy and oneDNN's blocked copy of that exist one chunk at a time (bf16 PrimaryCaps: two
  // 20 MB transients become 6 MB ones; docs/kernels.md). Each entry of dw reduces over the same products.
  const int64_t C = x.size(1);
  const int64_t bytes_per_channel = C > 0 ? window.numel() / C * window.element_size() : 1;
  const int64_t chunk = std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(bytes_per_channel, 1));
  auto dw = torch::empty({dy.size(1), C, kernel[0], kernel[1]}, x.options());  // dw: [O, C, K0, K1]
  for (int64_t c0 = 0; c0 < C; c0 += chunk) {
    const int64_t c1 = std::min(C, c0 + chunk);
    const auto xt = window.slice(1, c0, c1).transpose(0, 1).contiguous();  // xt: [c, N, rows, cols]
    // Stride and dilation trade places: output (kh, kw) reads x at d*kh + s*i.
    const auto z = at::conv2d(xt, dyt, torch::Tensor(), as_vector(g.dilation), std::vector<int64_t>{0, 0},
                              as_vector(g.stride));  // z: [c, O, K0, K1]
    dw.slice(1, c0, c1).copy_(z.transpose(0, 1));
  }
  return dw;
}

torch::Tensor conv2d_weight_grad_reference(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w,
                                           const Conv2dGeometry& g) {
  return std::get<1>(at::convolution_backward(dy, x, w, c10::nullopt, as_vector(g.stride), as_vector(g.padding),
                                              as_vector(g.dilation), /*transposed=*/false, {0, 0}, /*groups=*/1,
                                              {false, true, false}));
}

torch::Tensor conv2d_input_grad_by_phases(const torch::Tensor& dy, const torch::Tensor& w,
                                         std::array<int64_t, 2> input_size, const Conv2dGeometry& g) {
  TORCH_CHECK(dy.dim() == 4 && w.dim() == 4 && dy.size(1) == w.size(0),
              "conv2d_input_grad_by_phases: dy [N, O, P, Q] and w [O, C, K0, K1] must share O");
  TORCH_CHECK(g.dilation[0] == 1 && g.dilation[1] == 1, "conv2d_input_grad_by_phases: dilation must be 1");
  const int64_t s0 = g.stride[0], s1 = g.stride[1], K0 = w.size(2), K1 = w.size(3);
  const int64_t P = dy.size(2), Q = dy.size(3);
  // dx of the zero-padded input; rows and columns the forward never read keep a zero gradient.
  const int64_t Hp = input_size[0] + 2 * g.padding[0], Wp = input_size[1] + 2 * g.padding[1];
  TORCH_CHECK(s0 * (P - 1) + K0 <= Hp && s1 * (Q - 1) + K1 <= Wp,
              "conv2d_input_grad_by_phases: dy's spatial size does not fit the input's");
  auto dx = torch::zeros({dy.size(0), w.size(1), Hp, Wp}, dy.options());  // dx: [N, C, Hp, Wp]
  const auto dyc = dy.contiguous();
  for (int64_t ph = 0; ph < std::min(s0, K0); ++ph) {
    for (int64_t pw = 0; pw < std::min(s1, K1); ++pw) {
      // The phase's taps kh = s0 a + ph, kw = s1 b + pw, flipped (a correlation becomes a convolution)
      // and with in/out swapped: k: [C, O, ka, kb].
      const auto k = w.slice(2, ph, K0, s0).slice(3, pw, K1, s1).flip({2, 3}).transpose(0, 1).contiguous();
      const int64_t ka = k.size(2), kb = k.size(3);
      const auto r = at::conv2d(dyc, k, {}, {1, 1}, {ka - 1, kb - 1});  // r: [N, C, P + ka - 1, Q + kb - 1]
      // Phase row m is padded-input row s0 m + ph; the last reached is s0 (P - 1) + K0 - 1 < Hp.
      dx.slice(2, ph, Hp, s0).slice(3, pw, Wp, s1).slice(2, 0, P + ka - 1).slice(3, 0, Q + kb - 1).copy_(r);
    }
  }
  if (g.padding[0] == 0 && g.padding[1] == 0) return dx;
  return dx.slice(2, g.padding[0], g.padding[0] + input_size[0])
      .slice(3, g.padding[1], g.padding[1] + input_size[1])
      .contiguous();
}

torch::Tensor conv2d_input_grad_reference(const torch::Tensor& dy, const torch::Tensor& w,
                                          std::array<int64_t, 2> input_size, const Conv2dGeometry& g) {
  // convolution_backward reads only the input's shape and dtype for dx.
  const auto x = torch::empty({dy.size(0), w.size(1), input_size[0], input_size[1]}, dy.options());
  return std::get<0>(at::convolution_backward(dy, x, w, c10::nullopt, as_vector(g.stride), as_vector(g.padding),
                                              as_vector(g.dilation), /*transposed=*/false, {0, 0}, /*groups=*/1,
                                              {true, false, false}));
}

torch::Tensor conv2d_with_gradient_paths(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                         const Conv2dGeometry& geometry, ConvGradientPaths paths) {
  TORCH_CHECK(!paths.input_by_phases || (geometry.dilation[0] == 1 && geometry.dilation[1] == 1),
              "conv2d_with_gradient_paths: the input gradient by phases needs dilation 1");
  // Custom autograd functions take no undefined inputs: a missing bias is a zero one that needs no gradient.
  return Conv2dFunction::apply(x, w, b.defined() ? b : torch::zeros({w.size(0)}, w.options()), geometry, paths);
}

torch::Tensor conv2d_batch_swapped(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                   const Conv2dGeometry& geometry) {
  return conv2d_with_gradient_paths(x, w, b, geometry, {/*weight_batch_swapped=*/true, /*input_by_phases=*/false});
}

}  // namespace capsnet::kernels
