#include "capsnet/nn/spectral_conv.h"

#include "capsnet/nn/gemm.h"

namespace capsnet::nn {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

int64_t half_size(int64_t n) { return n / 2 + 1; }

// Angles 2 pi (k * step * r mod n) / n of the DFT matrices, in float64 (the reduction mod n keeps them exact).
torch::Tensor dft_angles(int64_t frequencies, int64_t samples, int64_t step, int64_t n) {
  const auto o = torch::TensorOptions().dtype(torch::kFloat64);
  const auto k = torch::arange(frequencies, o).unsqueeze(1), r = torch::arange(samples, o).unsqueeze(0) * step;
  return (k * r).remainder(n) * (kTwoPi / n);  // [frequencies, samples]
}

// The real DFT along the last axis: rows (part, k) for k < n/2 + 1, part 0 = cos, 1 = -sin (e^{-i a}).
torch::Tensor real_dft_matrix(int64_t n, int64_t step, int64_t used, const torch::TensorOptions& o) {
  const auto a = dft_angles(half_size(n), used, step, n);
  return torch::cat({torch::cos(a), -torch::sin(a)}, 0).to(o);  // [2 K, used]
}

// The complex DFT along the first spatial axis, acting on rows ordered (sample, part) and giving rows
// (part, k): out_re = C in_re + S in_im, out_im = -S in_re + C in_im (e^{-i a} = C - i S).
torch::Tensor complex_dft_matrix(int64_t n, int64_t step, int64_t used, const torch::TensorOptions& o) {
  const auto a = dft_angles(n, used, step, n);
  const auto c = torch::cos(a), s = torch::sin(a);
  const auto re = torch::stack({c, s}, 2).reshape({n, 2 * used});
  const auto im = torch::stack({-s, c}, 2).reshape({n, 2 * used});
  return torch::cat({re, im}, 0).to(o);  // [2 n, 2 used]
}

// The inverse along the first axis: rows (part, i) for positions step * i, columns (part, k), e^{+i a}.
torch::Tensor complex_idft_matrix(int64_t n, int64_t step, int64_t count, const torch::TensorOptions& o) {
  const auto a = dft_angles(n, count, step, n).t();  // [count, n]
  const auto c = torch::cos(a), s = torch::sin(a);
  return torch::cat({torch::cat({c, -s}, 1), torch::cat({s, c}, 1)}, 0).to(o);  // [2 count, 2 n]
}

// The inverse along the last axis to real samples at step * j, with the 1 / (n0 n1) of the whole 2-D
// inverse and the half spectrum's weights (2 for every k with a conjugate twin outside it): the real
// part of sum_k w_k (u_re + i u_im) e^{+i a} = w_k (u_re cos a - u_im sin a). Returns {re, im}: [K, count].
std::array<torch::Tensor, 2> real_idft_matrices(int64_t n0, int64_t n, int64_t step, int64_t count,
                                                const torch::TensorOptions& o) {
  const int64_t K = half_size(n);
  auto weight = torch::full({K, 1}, 2.0 / static_cast<double>(n0 * n), torch::kFloat64);
  weight[0] = 1.0 / static_cast<double>(n0 * n);
  if (n % 2 == 0) weight[K - 1] = 1.0 / static_cast<double>(n0 * n);
  const auto a = dft_angles(K, count, step, n);  // [K, count]
  return {(weight * torch::cos(a)).to(o), (-weight * torch::sin(a)).to(o)};
}

// Complex products per frequency with three real ones (Gauss). Spectra are [2, F, ., .]; the flags say
// which factor is conjugated / transposed (as a matrix, not conjugate-transposed).
//   forward:         Y = X conj(W)^T   ->  Yr = T1 + T2, Yi = T3 - T1 + T2, T3 = (Xr + Xi)(Wr - Wi)^T
//   input gradient:  dX = dZ W          ->  dXr = T1 - T2, dXi = T1 + T2 - T3, T3 = (Dr - Di)(Wr - Wi)
//   weight gradient: dW = conj(dZ)^T X  ->  dWr = T1 + T2, dWi = T1 - T2 - T3, T3 = (Dr + Di)^T (Xr - Xi)
// with T1 = ar br, T2 = ai bi (each with the transposes of the case).
torch::Tensor spectral_forward_product(const torch::Tensor& xs, const torch::Tensor& ws) {
  const int64_t F = xs.size(1), B = xs.size(2), O = ws.size(2);
  auto y = torch::empty({2, F, B, O}, xs.options());  // y: [2, F, B, O]
  auto yr = y[0], yi = y[1];
  auto t2 = torch::empty({F, B, O}, xs.options());
  batched_gemm_into(yr, xs[0], ws[0].transpose(1, 2));
  batched_gemm_into(t2, xs[1], ws[1].transpose(1, 2));
  batched_gemm_into(yi, xs[0] + xs[1], (ws[0] - ws[1]).transpose(1, 2));
  yi.add_(t2).sub_(yr);
  yr.add_(t2);
  return y;
}

torch::Tensor spectral_input_grad_product(const torch::Tensor& dz, const torch::Tensor& ws) {
  const int64_t F = dz.size(1), B = dz.size(2), C = ws.size(3);
  auto dx = torch::empty({2, F, B, C}, dz.options());  // dx: [2, F, B, C]
  auto dxr = dx[0], dxi = dx[1];
  auto t2 = torch::empty({F, B, C}, dz.options());
  batched_gemm_into(dxr, dz[0], ws[0]);
  batched_gemm_into(t2, dz[1], ws[1]);
  batched_gemm_into(dxi, dz[0] - dz[1], ws[0] - ws[1]);
  dxi.neg_().add_(dxr).add_(t2);
  dxr.sub_(t2);
  return dx;
}

torch::Tensor spectral_weight_grad_product(const torch::Tensor& dz, const torch::Tensor& xs) {
  const int64_t F = dz.size(1), O = dz.size(3), C = xs.size(3);
  auto dw = torch::empty({2, F, O, C}, dz.options());  // dw: [2, F, O, C]
  auto dwr = dw[0], dwi = dw[1];
  auto t2 = torch::empty({F, O, C}, dz.options());
  batched_gemm_into(dwr, dz[0].transpose(1, 2), xs[0]);
  batched_gemm_into(t2, dz[1].transpose(1, 2), xs[1]);
  batched_gemm_into(dwi, (dz[0] + dz[1]).transpose(1, 2), xs[0] - xs[1]);
  dwi.neg_().add_(dwr).sub_(t2);
  dwr.add_(t2);
  return dw;
}

struct SpectralGeometry {
  std::array<int64_t, 2> stride, kernel, output, circle;  // circle: the DFT sizes Nh, Nw
};

SpectralGeometry spectral_geometry(const torch::Tensor& x, const torch::Tensor& w, std::array<int64_t, 2> stride) {
  TORCH_CHECK(x.dim() == 4 && w.dim() == 4 && x.size(1) == w.size(1),
              "conv2d_spectral: x [N, C, H, W] and w [O, C, K0, K1] must share C, got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(stride[0] >= 1 && stride[1] >= 1, "conv2d_spectral: stride must be positive");
  TORCH_CHECK(x.size(2) >= w.size(2) && x.size(3) >= w.size(3), "conv2d_spectral: the kernel ", w.sizes(),
              " is larger than the input ", x.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble),
              "conv2d_spectral: x and w must both be float32 or float64");
  SpectralGeometry g{stride, {w.size(2), w.size(3)}, {}, {}};
  for (int d = 0; d < 2; ++d) {
    g.output[d] = (x.size(2 + d) - g.kernel[d]) / stride[d] + 1;
    g.circle[d] = stride[d] * (g.output[d] - 1) + g.kernel[d];
  }
  return g;
}

std::vector<int64_t> as_vector(const std::array<int64_t, 2>& a) { return {a[0], a[1]}; }
std::array<int64_t, 2> as_array(const c10::IValue& v) {
  const auto list = v.toIntVector();
  return {list[0], list[1]};
}

class SpectralConv2dFunction : public torch::autograd::Function<SpectralConv2dFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& w_in, const torch::Tensor& b, std::array<int64_t, 2> stride) {
    const auto x = x_in.contiguous(), w = w_in.contiguous();
    const auto g = spectral_geometry(x, w, stride);
    const auto xs = real_spectrum(x, g.circle, {1, 1}, g.circle);   // xs: [2, F, N, C]
    const auto ws = real_spectrum(w, g.circle, {1, 1}, g.kernel);   // ws: [2, F, O, C]
    const auto ys = spectral_forward_product(xs, ws);              // ys: [2, F, N, O]
    auto y = torch::empty({x.size(0), w.size(0), g.output[0], g.output[1]}, x.options());
    inverse_real_spectrum_into(y, ys, g.circle, g.stride, g.output);
    if (b.defined()) y.add_(b.view({1, -1, 1, 1}));
    // The backward needs x only through its spectrum (about x's size); w's is recomputed there
    // (2.7x w's size, kept out of the step's peak).
    ctx->save_for_backward({xs, w});
    ctx->saved_data["stride"] = as_vector(stride);
    ctx->saved_data["input_size"] = std::vector<int64_t>{x.size(2), x.size(3)};
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xs = saved[0];
    const auto& w = saved[1];
    const auto stride = as_array(ctx->saved_data["stride"]);
    const auto input_size = as_array(ctx->saved_data["input_size"]);
    const auto dy = grads[0].contiguous();  // dy: [N, O, P, Q]
    const std::array<int64_t, 2> kernel{w.size(2), w.size(3)}, output{dy.size(2), dy.size(3)};
    const std::array<int64_t, 2> circle{stride[0] * (output[0] - 1) + kernel[0], stride[1] * (output[1] - 1) + kernel[1]};
    // dy sits at the strided positions of the full correlation's output.
    const auto dz = real_spectrum(dy, circle, stride, output);  // dz: [2, F, N, O]
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      const auto ws = real_spectrum(w, circle, {1, 1}, kernel);
      const auto dxs = spectral_input_grad_product(dz, ws);  // dxs: [2, F, N, C]
      dx = torch::empty({dy.size(0), w.size(1), input_size[0], input_size[1]}, dy.options());
      // Rows and columns past the circle were never read: zero gradient.
      dx.narrow(2, circle[0], input_size[0] - circle[0]).zero_();
      dx.narrow(3, circle[1], input_size[1] - circle[1]).zero_();
      inverse_real_spectrum_into(dx, dxs, circle, {1, 1}, circle);
    }
    if (ctx->needs_input_grad(1)) {
      const auto dws = spectral_weight_grad_product(dz, xs);  // dws: [2, F, O, C]
      dw = torch::empty(w.sizes(), w.options());
      inverse_real_spectrum_into(dw, dws, circle, {1, 1}, kernel);
    }
    if (ctx->needs_input_grad(2)) db = dy.sum({0, 2, 3});
    return {dx, dw, db, torch::Tensor()};
  }
};

}  // namespace

bool spectral_conv_pays_off(std::array<int64_t, 2> kernel, std::array<int64_t, 2> output,
                            std::array<int64_t, 2> stride) {
  const int64_t n0 = stride[0] * (output[0] - 1) + kernel[0], n1 = stride[1] * (output[1] - 1) + kernel[1];
  const int64_t direct = kernel[0] * kernel[1] * output[0] * output[1];
  const int64_t spectral = 3 * n0 * half_size(n1);
  return direct >= 3 * spectral;
}

torch::Tensor real_spectrum(const torch::Tensor& t, std::array<int64_t, 2> n, std::array<int64_t, 2> step,
                            std::array<int64_t, 2> used) {
  TORCH_CHECK(t.dim() == 4 && t.is_contiguous(), "real_spectrum: t must be a contiguous [P, Q, R, S] tensor");
  TORCH_CHECK(used[0] <= t.size(2) && used[1] <= t.size(3) && used[0] >= 1 && used[1] >= 1,
              "real_spectrum: uses more samples than t has");
  TORCH_CHECK(step[0] * (used[0] - 1) < n[0] && step[1] * (used[1] - 1) < n[1],
              "real_spectrum: the samples do not fit the circle");
  const int64_t P = t.size(0), Q = t.size(1), R = t.size(2), S = t.size(3), PQ = P * Q, K = half_size(n[1]);
  const auto tv = t.view({PQ, R, S});
  // Along the last axis, one product per row r: a[r] = M_w t[:, :, r, :]^T (t read in place, transposed).
  const auto mw = real_dft_matrix(n[1], step[1], used[1], t.options());  // mw: [2 K, used1]
  auto a = torch::empty({used[0], 2 * K, PQ}, t.options());               // a: [r, (part, k1), PQ]
  for (int64_t r = 0; r < used[0]; ++r) {
    auto ar = a[r];
    gemm_into(ar, mw, tv.select(1, r).narrow(1, 0, used[1]).t());
  }
  // Along the first axis, one product over rows (r, part): spec[(part, k0), (k1, PQ)].
  const auto mh = complex_dft_matrix(n[0], step[0], used[0], t.options());  // mh: [2 n0, 2 used0]
  auto spec = torch::empty({2, n[0] * K, P, Q}, t.options());
  auto spec2d = spec.view({2 * n[0], K * PQ});
  gemm_into(spec2d, mh, a.view({2 * used[0], K * PQ}));
  return spec;
}

void inverse_real_spectrum_into(torch::Tensor& out, const torch::Tensor& spec, std::array<int64_t, 2> n,
                                std::array<int64_t, 2> step, std::array<int64_t, 2> count) {
  const int64_t K = half_size(n[1]);
  TORCH_CHECK(spec.dim() == 4 && spec.size(0) == 2 && spec.size(1) == n[0] * K && spec.is_contiguous(),
              "inverse_real_spectrum_into: spec must be a contiguous [2, n0 (n1/2 + 1), P, Q] tensor");
  TORCH_CHECK(out.dim() == 4 && out.is_contiguous() && out.size(0) == spec.size(2) && out.size(1) == spec.size(3) &&
                  out.size(2) >= count[0] && out.size(3) >= count[1],
              "inverse_real_spectrum_into: out must be a contiguous [P, Q, >= count0, >= count1] tensor");
  const int64_t PQ = spec.size(2) * spec.size(3), Ho = out.size(2), Wo = out.size(3);
  // Along the first axis: u[(part, i), (k1, PQ)].
  const auto ih = complex_idft_matrix(n[0], step[0], count[0], spec.options());  // ih: [2 count0, 2 n0]
  auto u = torch::empty({2, count[0], K, PQ}, spec.options());
  auto u2d = u.view({2 * count[0], K * PQ});
  gemm_into(u2d, ih, spec.view({2 * n[0], K * PQ}));
  // Along the last axis, straight into out's rows: out[:, :, i, :count1] = u_re[i]^T iw_re + u_im[i]^T iw_im.
  const auto iw = real_idft_matrices(n[0], n[1], step[1], count[1], spec.options());  // each [K, count1]
  const auto out2d = out.view({PQ, Ho * Wo});
  for (int64_t i = 0; i < count[0]; ++i) {
    auto dst = out2d.narrow(1, i * Wo, count[1]);
    gemm_into(dst, u[0][i].t(), iw[0]);
    gemm_into(dst, u[1][i].t(), iw[1], 1.0, 1.0);
  }
}

torch::Tensor conv2d_spectral(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                              std::array<int64_t, 2> stride) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "conv2d_spectral: CPU tensors only");
  // Custom autograd functions take no undefined inputs: a missing bias is a zero one that needs no gradient.
  return SpectralConv2dFunction::apply(x, w, b.defined() ? b : torch::zeros({w.size(0)}, w.options()), stride);
}

}  // namespace capsnet::nn
