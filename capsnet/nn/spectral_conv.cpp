#include "capsnet/nn/spectral_conv.h"

#include "capsnet/nn/gemm.h"

#include <algorithm>

namespace capsnet::nn {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

int64_t half_size(int64_t n) { return n / 2 + 1; }

// The DFT size along one axis: the extent of the input that an output of `output` samples at `stride`
// reads with a `kernel`-tap kernel.
int64_t circle_size(int64_t kernel, int64_t output, int64_t stride) { return stride * (output - 1) + kernel; }

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

// The spectra's two stages. Along the last axis, one product per sample row r (t read in place,
// transposed): a[r] = M_last t[:, :, r, :]^T. t: [P, Q, R, S] contiguous -> a: [used0, 2 K, P Q].
torch::Tensor last_axis_spectrum(const torch::Tensor& t, int64_t n, int64_t step, std::array<int64_t, 2> used) {
  const int64_t PQ = t.size(0) * t.size(1), K = half_size(n);
  const auto tv = t.view({PQ, t.size(2), t.size(3)});
  const auto m = real_dft_matrix(n, step, used[1], t.options());  // m: [2 K, used1]
  auto a = torch::empty({used[0], 2 * K, PQ}, t.options());      // a: [r, (part, k1), PQ]
  for (int64_t r = 0; r < used[0]; ++r) {
    auto ar = a[r];
    gemm_into(ar, m, tv.select(1, r).narrow(1, 0, used[1]).t());
  }
  return a;
}

// Along the first axis, for the frequency rows k0 in [k_begin, k_end) only: one product over the rows
// (r, part) of a -> [2, (k_end - k_begin) K, P, Q].
torch::Tensor first_axis_spectrum(const torch::Tensor& a, int64_t n, int64_t step, int64_t k_begin, int64_t k_end,
                                  int64_t P, int64_t Q) {
  const int64_t used = a.size(0), K = a.size(1) / 2, rows = k_end - k_begin;
  const auto m = complex_dft_matrix(n, step, used, a.options());  // m: [(part, k0), (r, part)]
  const auto chunk = torch::cat({m.narrow(0, k_begin, rows), m.narrow(0, n + k_begin, rows)}, 0);
  auto spec = torch::empty({2, rows * K, P, Q}, a.options());
  auto spec2d = spec.view({2 * rows, K * P * Q});
  gemm_into(spec2d, chunk, a.view({2 * used, K * P * Q}));
  return spec;
}

// The inverse's first stage for the frequency rows [k_begin, k_begin + rows) of spec ([2, rows K, P, Q]):
// u += (or, first, =) M^-1[:, those rows] spec, u: [(part, i), (k1, PQ)] for positions step i, i < count.
void first_axis_inverse_accumulate(torch::Tensor& u, const torch::Tensor& spec, int64_t n, int64_t step,
                                   int64_t count, int64_t k_begin, bool first) {
  const int64_t K = u.size(1) / (spec.size(2) * spec.size(3)), rows = spec.size(1) / K;
  const auto m = complex_idft_matrix(n, step, count, spec.options());  // m: [2 count, (part, k0)]
  const auto chunk = torch::cat({m.narrow(1, k_begin, rows), m.narrow(1, n + k_begin, rows)}, 1);
  gemm_into(u, chunk, spec.view({2 * rows, -1}), 1.0, first ? 0.0 : 1.0);
}

// The inverse's last stage, straight into out's rows: out[:, :, i, :count1] = u_re[i]^T iw_re + u_im[i]^T iw_im.
// u: [2 count0, K PQ]; out: [P, Q, >= count0, >= count1] contiguous.
void last_axis_inverse_into(torch::Tensor& out, const torch::Tensor& u, std::array<int64_t, 2> n, int64_t step,
                            std::array<int64_t, 2> count) {
  const int64_t PQ = out.size(0) * out.size(1), Ho = out.size(2), Wo = out.size(3), K = half_size(n[1]);
  const auto iw = real_idft_matrices(n[0], n[1], step, count[1], out.options());  // each [K, count1]
  const auto uv = u.view({2, count[0], K, PQ});
  const auto out2d = out.view({PQ, Ho * Wo});
  for (int64_t i = 0; i < count[0]; ++i) {
    auto dst = out2d.narrow(1, i * Wo, count[1]);
    gemm_into(dst, uv[0][i].t(), iw[0]);
    gemm_into(dst, uv[1][i].t(), iw[1], 1.0, 1.0);
  }
}

// The complex products per frequency, with three real ones each (Gauss), over one chunk of frequencies
// (the weight side's spectra, [2, F, O, C], exist one chunk at a time). Spectra are [2, F, ., .] (real,
// imaginary). With T1 = (real x real) and T2 = (imaginary x imaginary) of the same transposes:
//   forward:         Y = X conj(W)^T   ->  Yr = T1 + T2, Yi = T3 - T1 + T2, T3 = (Xr + Xi)(Wr - Wi)^T
//   input gradient:  dX = dZ W          ->  dXr = T1 - T2, dXi = T1 + T2 - T3, T3 = (Dr - Di)(Wr - Wi)
//   weight gradient: dW = conj(dZ)^T X  ->  dWr = T1 + T2, dWi = T1 - T2 - T3, T3 = (Dr + Di)^T (Xr - Xi)
// T2 goes into the imaginary output first and T3 is accumulated last, so no scratch is needed.

// ys = the forward's products. xs: [2, f, B, C]; xsum: [f, B, C]; ws: [2, f, O, C]; ys: [2, f, B, O].
void forward_products(torch::Tensor& ys, const torch::Tensor& xs, const torch::Tensor& xsum, const torch::Tensor& ws) {
  auto yr = ys[0], yi = ys[1];
  batched_gemm_into(yr, xs[0], ws[0].transpose(1, 2));                               // T1
  batched_gemm_into(yi, xs[1], ws[1].transpose(1, 2));                               // T2
  yr.add_(yi);                                                                       // T1 + T2
  yi.mul_(2).sub_(yr);                                                               // T2 - T1
  batched_gemm_into(yi, xsum, (ws[0] - ws[1]).transpose(1, 2), 1.0, 1.0);            // + T3
}

// dxs = the input gradient's products. dz: [2, f, B, O]; ddiff = Dr - Di: [f, B, O]; ws: [2, f, O, C];
// dxs: [2, f, B, C].
void input_grad_products(torch::Tensor& dxs, const torch::Tensor& dz, const torch::Tensor& ddiff,
                         const torch::Tensor& ws) {
  auto dxr = dxs[0], dxi = dxs[1];
  batched_gemm_into(dxr, dz[0], ws[0]);                                              // T1
  batched_gemm_into(dxi, dz[1], ws[1]);                                              // T2
  dxr.sub_(dxi);                                                                     // T1 - T2
  dxi.mul_(2).add_(dxr);                                                             // T1 + T2
  batched_gemm_into(dxi, ddiff, ws[0] - ws[1], -1.0, 1.0);                           // - T3
}

// dws = the weight gradient's products. dz: [2, f, B, O]; dsum = Dr + Di: [f, B, O]; xs: [2, f, B, C];
// xdiff = Xr - Xi: [f, B, C]; dws: [2, f, O, C].
void weight_grad_products(torch::Tensor& dws, const torch::Tensor& dz, const torch::Tensor& dsum,
                          const torch::Tensor& xs, const torch::Tensor& xdiff) {
  auto dwr = dws[0], dwi = dws[1];
  batched_gemm_into(dwr, dz[0].transpose(1, 2), xs[0]);                              // T1
  batched_gemm_into(dwi, dz[1].transpose(1, 2), xs[1]);                              // T2
  dwr.add_(dwi);                                                                     // T1 + T2
  dwi.mul_(-2).add_(dwr);                                                            // T1 - T2
  batched_gemm_into(dwi, dsum.transpose(1, 2), xdiff, -1.0, 1.0);                    // - T3
}

// Frequency rows k0 per chunk: the most whose slice of the weight's spectrum ([2, rows K, O, C]) fits
// chunk_bytes (at least one).
int64_t rows_per_chunk(int64_t K, int64_t O, int64_t C, int64_t element_size, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(2 * K * O * C * element_size, 1));
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
    g.circle[d] = circle_size(g.kernel[d], g.output[d], stride[d]);
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
                               const torch::Tensor& w_in, const torch::Tensor& b, std::array<int64_t, 2> stride,
                               int64_t chunk_bytes) {
    const auto x = x_in.contiguous(), w = w_in.contiguous();
    const auto g = spectral_geometry(x, w, stride);
    const int64_t N = x.size(0), C = x.size(1), O = w.size(0), K = half_size(g.circle[1]);
    const auto xs = real_spectrum(x, g.circle, {1, 1}, g.circle);  // xs: [2, F, N, C]
    const auto xsum = xs[0] + xs[1];
    // w's spectrum a chunk of frequency rows at a time, from its last-axis stage (2 K / K1 of w's size).
    const auto wa = last_axis_spectrum(w, g.circle[1], 1, g.kernel);  // wa: [K0, 2 K, O C]
    const int64_t rows = rows_per_chunk(K, O, C, w.element_size(), chunk_bytes);
    auto u = torch::empty({2 * g.output[0], K * N * O}, x.options());  // the inverse's first stage
    for (int64_t k0 = 0; k0 < g.circle[0]; k0 += rows) {
      const int64_t r = std::min(rows, g.circle[0] - k0);
      const auto ws = first_axis_spectrum(wa, g.circle[0], 1, k0, k0 + r, O, C);  // ws: [2, r K, O, C]
      auto ys = torch::empty({2, r * K, N, O}, x.options());
      forward_products(ys, xs.narrow(1, k0 * K, r * K), xsum.narrow(0, k0 * K, r * K), ws);
      first_axis_inverse_accumulate(u, ys, g.circle[0], g.stride[0], g.output[0], k0, k0 == 0);
    }
    auto y = torch::empty({N, O, g.output[0], g.output[1]}, x.options());
    last_axis_inverse_into(y, u, g.circle, g.stride[1], g.output);
    if (b.defined()) y.add_(b.view({1, -1, 1, 1}));
    // The backward needs x only through its spectrum (about x's size); w's is recomputed there.
    ctx->save_for_backward({xs, w});
    ctx->saved_data["stride"] = as_vector(stride);
    ctx->saved_data["input_size"] = std::vector<int64_t>{x.size(2), x.size(3)};
    ctx->saved_data["chunk_bytes"] = chunk_bytes;
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
    const int64_t N = dy.size(0), O = w.size(0), C = w.size(1);
    const std::array<int64_t, 2> kernel{w.size(2), w.size(3)}, output{dy.size(2), dy.size(3)};
    const std::array<int64_t, 2> circle{circle_size(kernel[0], output[0], stride[0]),
                                        circle_size(kernel[1], output[1], stride[1])};
    const int64_t K = half_size(circle[1]);
    const int64_t rows = rows_per_chunk(K, O, C, w.element_size(), ctx->saved_data["chunk_bytes"].toInt());
    // dy sits at the strided positions of the full correlation's output.
    const auto dz = real_spectrum(dy, circle, stride, output);  // dz: [2, F, N, O]
    torch::Tensor dx, dw, db;
    // dx first: measured 20 MB lower peak than dW first (bench, batch 100).
    if (ctx->needs_input_grad(0)) {
      const auto ddiff = dz[0] - dz[1];
      const auto wa = last_axis_spectrum(w, circle[1], 1, kernel);
      auto u = torch::empty({2 * circle[0], K * N * C}, dy.options());
      for (int64_t k0 = 0; k0 < circle[0]; k0 += rows) {
        const int64_t r = std::min(rows, circle[0] - k0);
        const auto ws = first_axis_spectrum(wa, circle[0], 1, k0, k0 + r, O, C);
        auto dxs = torch::empty({2, r * K, N, C}, dy.options());
        input_grad_products(dxs, dz.narrow(1, k0 * K, r * K), ddiff.narrow(0, k0 * K, r * K), ws);
        first_axis_inverse_accumulate(u, dxs, circle[0], 1, circle[0], k0, k0 == 0);
      }
      dx = torch::empty({N, C, input_size[0], input_size[1]}, dy.options());
      // Rows and columns past the circle were never read: zero gradient.
      dx.narrow(2, circle[0], input_size[0] - circle[0]).zero_();
      dx.narrow(3, circle[1], input_size[1] - circle[1]).zero_();
      last_axis_inverse_into(dx, u, circle, 1, circle);
    }
    if (ctx->needs_input_grad(1)) {
      const auto dsum = dz[0] + dz[1], xdiff = xs[0] - xs[1];
      auto u = torch::empty({2 * kernel[0], K * O * C}, dy.options());
      for (int64_t k0 = 0; k0 < circle[0]; k0 += rows) {
        const int64_t r = std::min(rows, circle[0] - k0);
        auto dws = torch::empty({2, r * K, O, C}, dy.options());
        weight_grad_products(dws, dz.narrow(1, k0 * K, r * K), dsum.narrow(0, k0 * K, r * K),
                             xs.narrow(1, k0 * K, r * K), xdiff.narrow(0, k0 * K, r * K));
        first_axis_inverse_accumulate(u, dws, circle[0], 1, kernel[0], k0, k0 == 0);
      }
      dw = torch::empty(w.sizes(), w.options());
      last_axis_inverse_into(dw, u, circle, 1, kernel);
    }
    if (ctx->needs_input_grad(2)) db = dy.sum({0, 2, 3});
    return {dx, dw, db, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool spectral_conv_pays_off(std::array<int64_t, 2> kernel, std::array<int64_t, 2> output,
                            std::array<int64_t, 2> stride) {
  const int64_t n0 = circle_size(kernel[0], output[0], stride[0]), n1 = circle_size(kernel[1], output[1], stride[1]);
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
  const auto a = last_axis_spectrum(t, n[1], step[1], used);
  return first_axis_spectrum(a, n[0], step[0], 0, n[0], t.size(0), t.size(1));
}

void inverse_real_spectrum_into(torch::Tensor& out, const torch::Tensor& spec, std::array<int64_t, 2> n,
                                std::array<int64_t, 2> step, std::array<int64_t, 2> count) {
  const int64_t K = half_size(n[1]);
  TORCH_CHECK(spec.dim() == 4 && spec.size(0) == 2 && spec.size(1) == n[0] * K && spec.is_contiguous(),
              "inverse_real_spectrum_into: spec must be a contiguous [2, n0 (n1/2 + 1), P, Q] tensor");
  TORCH_CHECK(out.dim() == 4 && out.is_contiguous() && out.size(0) == spec.size(2) && out.size(1) == spec.size(3) &&
                  out.size(2) >= count[0] && out.size(3) >= count[1],
              "inverse_real_spectrum_into: out must be a contiguous [P, Q, >= count0, >= count1] tensor");
  auto u = torch::empty({2 * count[0], K * spec.size(2) * spec.size(3)}, spec.options());
  first_axis_inverse_accumulate(u, spec, n[0], step[0], count[0], 0, true);
  last_axis_inverse_into(out, u, n, step[1], count);
}

torch::Tensor conv2d_spectral(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                              std::array<int64_t, 2> stride, int64_t chunk_bytes) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "conv2d_spectral: CPU tensors only");
  // Custom autograd functions take no undefined inputs: a missing bias is a zero one that needs no gradient.
  return SpectralConv2dFunction::apply(x, w, b.defined() ? b : torch::zeros({w.size(0)}, w.options()), stride,
                                       chunk_bytes);
}

}  // namespace capsnet::nn
