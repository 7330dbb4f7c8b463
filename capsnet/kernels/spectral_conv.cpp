#include "capsnet/kernels/spectral_conv.h"

#include "capsnet/kernels/gemm.h"
#include "capsnet/kernels/saved_pairs.h"
#include "capsnet/kernels/sign_mask.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace capsnet::kernels {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

// A named scope of the training step's parts for LibTorch's profiler ("spectral::..."; nothing is recorded
// unless a profiler runs: bench/bench_layers.cpp with CAPSNET_PROFILE_TRACE, bench/profile_summary.py).
#define CAPSNET_PROFILE_SCOPE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

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

// The DFT matrices of a geometry, made once per process: a PrimaryCaps training step asks for ~70 of them (per
// chunk of frequency columns and pass), each ~10 small ATen ops from float64 angles (~30 us per matrix:
// about 1% of a bf16 inference batch of 100). Key: (which matrix, its integer arguments, dtype); the matrices are read, never written.
// Bounded: a process that sees many geometries (the tests) starts over past kMaxCachedMatrices.
constexpr size_t kMaxCachedMatrices = 512;

template <class Make>
torch::Tensor cached_matrix(int which, std::array<int64_t, 6> args, const torch::TensorOptions& o, Make make) {
  using Key = std::tuple<int, std::array<int64_t, 6>, c10::ScalarType, c10::DeviceType, c10::DeviceIndex>;
  static std::mutex mutex;
  static std::map<Key, torch::Tensor> cache;
  const Key key{which, args, o.dtype().toScalarType(), o.device().type(), o.device().index()};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = cache.find(key); it != cache.end()) return it->second;
  }
  auto m = make();  // outside the lock: two threads may make the same matrix; both are equal
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() >= kMaxCachedMatrices) cache.clear();
  return cache.emplace(key, m).first->second;
}

// The real DFT along the last axis: rows (part, k) for k < n/2 + 1, part 0 = cos, 1 = -sin (e^{-i a}).
torch::Tensor make_real_dft_matrix(int64_t n, int64_t step, int64_t used, const torch::TensorOptions& o) {
  const auto a = dft_angles(half_size(n), used, step, n);
  return torch::cat({torch::cos(a), -torch::sin(a)}, 0).to(o);  // [2 K, used]
}

// The complex DFT along the first spatial axis, acting on rows ordered (sample, part) and giving rows
// (part, k): out_re = C in_re + S in_im, out_im = -S in_re + C in_im (e^{-i a} = C - i S).
torch::Tensor make_complex_dft_matrix(int64_t n, int64_t step, int64_t used, const torch::TensorOptions& o) {
  const auto a = dft_angles(n, used, step, n);
  const auto c = torch::cos(a), s = torch::sin(a);
  const auto re = torch::stack({c, s}, 2).reshape({n, 2 * used});
  const auto im = torch::stack({-s, c}, 2).reshape({n, 2 * used});
  return torch::cat({re, im}, 0).to(o);  // [2 n, 2 used]
}

// The inverse along the first axis: rows (i, part) for positions step * i, columns (part, k), e^{+i a}.
torch::Tensor make_complex_idft_matrix(int64_t n, int64_t step, int64_t count, const torch::TensorOptions& o) {
  const auto a = dft_angles(n, count, step, n).t();  // [count, n]
  const auto c = torch::cos(a), s = torch::sin(a);
  return torch::stack({torch::cat({c, -s}, 1), torch::cat({s, c}, 1)}, 1).reshape({2 * count, 2 * n}).to(o);
}

// The inverse along the last axis to real samples at step * j, with the 1 / (n0 n1) of the whole 2-D
// inverse and the half spectrum's weights (2 for every k with a conjugate twin outside it): the real
// part of sum_k w_k (u_re + i u_im) e^{+i a} = w_k (u_re cos a - u_im sin a). Rows (part, k): [2 K, count].
torch::Tensor make_real_idft_matrix(int64_t n0, int64_t n, int64_t step, int64_t count, const torch::TensorOptions& o) {
  const int64_t K = half_size(n);
  auto weight = torch::full({K, 1}, 2.0 / static_cast<double>(n0 * n), torch::kFloat64);
  weight[0] = 1.0 / static_cast<double>(n0 * n);
  if (n % 2 == 0) weight[K - 1] = 1.0 / static_cast<double>(n0 * n);
  const auto a = dft_angles(K, count, step, n);  // [K, count]
  return torch::cat({weight * torch::cos(a), -weight * torch::sin(a)}, 0).to(o);
}

// The matrices above, each made once per geometry and dtype (cached_matrix).
torch::Tensor real_dft_matrix(int64_t n, int64_t step, int64_t used, const torch::TensorOptions& o) {
  return cached_matrix(0, {n, step, used}, o, [&] { return make_real_dft_matrix(n, step, used, o); });
}
torch::Tensor complex_dft_matrix(int64_t n, int64_t step, int64_t used, const torch::TensorOptions& o) {
  return cached_matrix(1, {n, step, used}, o, [&] { return make_complex_dft_matrix(n, step, used, o); });
}
torch::Tensor complex_idft_matrix(int64_t n, int64_t step, int64_t count, const torch::TensorOptions& o) {
  return cached_matrix(2, {n, step, count}, o, [&] { return make_complex_idft_matrix(n, step, count, o); });
}
// make_real_idft_matrix's [2 K, count1] repeated for `rows` output rows, [rows, 2 K, count1]: the batched product's
// right operand in last_axis_inverse_into.
torch::Tensor real_idft_matrices(int64_t n0, int64_t n, int64_t step, int64_t count, int64_t rows,
                                 const torch::TensorOptions& o) {
  return cached_matrix(3, {n0, n, step, count, rows}, o, [&] {
    const auto iw = make_real_idft_matrix(n0, n, step, count, o);
    return iw.expand({rows, iw.size(0), iw.size(1)}).contiguous();
  });
}

// The spectra's two stages. Along the last axis, one product per sample row r (t read in place,
// transposed): a[r] = M_last t[:, :, r, :]^T. t: [P, Q, R, S] contiguous -> a: [used0, 2 K, P Q].
// relu: of relu(t), a row at a time through a scratch row ([P Q, used1]): relu(t) is never made whole
// (PrimaryCaps' input: 41 MB in fp32, on the forward's peak beside t, x's spectrum and this stage).
torch::Tensor last_axis_spectrum(const torch::Tensor& t, int64_t n, int64_t step, std::array<int64_t, 2> used,
                                 bool relu = false) {
  const int64_t PQ = t.size(0) * t.size(1), K = half_size(n);
  const auto tv = t.view({PQ, t.size(2), t.size(3)});
  const auto m = real_dft_matrix(n, step, used[1], t.options());  // m: [2 K, used1]
  auto a = torch::empty({used[0], 2 * K, PQ}, t.options());      // a: [r, (part, k1), PQ]
  auto scratch = relu ? torch::empty({PQ, used[1]}, t.options()) : torch::Tensor();
  for (int64_t r = 0; r < used[0]; ++r) {
    auto ar = a[r];
    const auto row = tv.select(1, r).narrow(1, 0, used[1]);  // row: [PQ, used1]
    gemm_into(ar, m, relu ? torch::clamp_min_out(scratch, row, 0).t() : row.t());
  }
  return a;
}

// Along the first axis, for the frequency columns k1 in [k_begin, k_begin + count) only: one product
// over the rows (r, part) of a (a row stride of K P Q), [2 n, 2 used] x [2 used, count P Q] ->
// [2, n count, P, Q] (frequencies (k0, k1) in that order). bf16, some of the columns: the rows are copied
// dense first, since oneDNN 2.6's fast bf16 matmul (brgemm) takes dense operands only and runs a strided
// one on its generic kernel at half the rate (PrimaryCaps' chunk [38, 38] x [38, 25,600] on a 2-core Zen 5:
// 0.40 ms strided, 0.16 dense; docs/kernels.md).
torch::Tensor first_axis_spectrum(const torch::Tensor& a, int64_t n, int64_t step, int64_t k_begin, int64_t count,
                                  int64_t P, int64_t Q) {
  const int64_t used = a.size(0), K = a.size(1) / 2, PQ = P * Q;
  const auto m = complex_dft_matrix(n, step, used, a.options());  // m: [(part, k0), (r, part)]
  auto spec = torch::empty({2, n * count, P, Q}, a.options());
  auto spec2d = spec.view({2 * n, count * PQ});
  auto columns = a.view({2 * used, K * PQ}).narrow(1, k_begin * PQ, count * PQ);  // [(r, part), (k1, PQ)]
  if (a.scalar_type() == torch::kBFloat16 && count < K) columns = columns.contiguous();
  gemm_into(spec2d, m, columns);
  return spec;
}

// real_spectrum's two stages (unchecked), of relu(t) where `relu`.
torch::Tensor two_stage_spectrum(const torch::Tensor& t, std::array<int64_t, 2> n, std::array<int64_t, 2> step,
                                 std::array<int64_t, 2> used, bool relu) {
  const auto a = last_axis_spectrum(t, n[1], step[1], used, relu);
  return first_axis_spectrum(a, n[0], step[0], 0, half_size(n[1]), t.size(0), t.size(1));
}

// The 2-D DFT of K0 x K1 samples (step 1) for the frequency columns k1 in [k_begin, k_begin + count): rows
// (part, k0, k1), columns (r, s); part 0 = cos, 1 = -sin of 2 pi (k0 r / n0 + k1 s / n1).
torch::Tensor make_kernel_dft_matrix(std::array<int64_t, 2> n, std::array<int64_t, 2> kernel, int64_t k_begin,
                                     int64_t count, const torch::TensorOptions& o) {
  const auto a0 = dft_angles(n[0], kernel[0], 1, n[0]);                                   // [n0, K0]
  const auto a1 = dft_angles(k_begin + count, kernel[1], 1, n[1]).narrow(0, k_begin, count);  // [count, K1]
  const auto a = (a0.view({n[0], 1, kernel[0], 1}) + a1.view({1, count, 1, kernel[1]}))
                     .reshape({n[0] * count, kernel[0] * kernel[1]});
  return torch::cat({torch::cos(a), -torch::sin(a)}, 0).to(o);  // [2 n0 count, K0 K1]
}

torch::Tensor kernel_dft_matrix(std::array<int64_t, 2> n, std::array<int64_t, 2> kernel, int64_t k_begin,
                                int64_t count, const torch::TensorOptions& o) {
  return cached_matrix(4, {n[0], n[1], kernel[0], kernel[1], k_begin, count}, o,
                       [&] { return make_kernel_dft_matrix(n, kernel, k_begin, count, o); });
}

// A kernel's spectrum on the n0 x n1 circle, a chunk of frequency columns at a time, as
// [2, n0 count, P, Q] (frequencies (k0, k1)). planes: [P, Q, K0, K1] contiguous. fp32 and fp64: the two
// stages, the last axis's once for all chunks. bf16: one product per chunk with the 2-D DFT matrix
// (K0 K1 terms: 3.6x the multiply-adds for PrimaryCaps' 9 x 9, but a shape bf16 GEMMs run well, measured
// 5.7 against 10 ms per pass, and no last-axis stage to hold: 24 MB).
class KernelSpectrum {
 public:
  KernelSpectrum(torch::Tensor planes, std::array<int64_t, 2> n)
      : planes_(std::move(planes)), n_(n), kernel_{planes_.size(2), planes_.size(3)},
        P_(planes_.size(0)), Q_(planes_.size(1)) {
    if (planes_.scalar_type() != torch::kBFloat16) {
      last_axis_ = last_axis_spectrum(planes_, n[1], 1, kernel_);
      planes_ = torch::Tensor();  // every chunk reads last_axis_ alone: the planes (fp32 w^T: 21 MB) can go
    }
  }

  torch::Tensor columns(int64_t k_begin, int64_t count) const {
    if (last_axis_.defined()) return first_axis_spectrum(last_axis_, n_[0], 1, k_begin, count, P_, Q_);
    auto spec = torch::empty({2, n_[0] * count, P_, Q_}, planes_.options());
    columns_into(spec, k_begin, count);
    return spec;
  }

  // bf16 only: the columns written into `out` ([2, n0 count, P, Q], contiguous), e.g. part of a larger buffer.
  void columns_into(const torch::Tensor& out, int64_t k_begin, int64_t count) const {
    TORCH_INTERNAL_ASSERT(planes_.defined() && out.is_contiguous() && out.size(1) == n_[0] * count);
    auto out2d = out.view({2 * n_[0] * count, P_ * Q_});
    gemm_into(out2d, kernel_dft_matrix(n_, kernel_, k_begin, count, planes_.options()),
              planes_.view({P_ * Q_, kernel_[0] * kernel_[1]}).t());
  }

 private:
  torch::Tensor planes_, last_axis_;  // planes_: bf16 only; last_axis_: [K0, 2 (n1 / 2 + 1), P Q] (fp32, fp64)
  std::array<int64_t, 2> n_, kernel_;
  int64_t P_, Q_;
};

// The spectrum of w^T's planes ([C, O] per frequency: the forward products' right operands untransposed),
// w^T made in `dtype` in one copy. w: [O, C, K0, K1].
KernelSpectrum transposed_kernel_spectrum(const torch::Tensor& w, torch::ScalarType dtype, std::array<int64_t, 2> n) {
  auto wt = torch::empty({w.size(1), w.size(0), w.size(2), w.size(3)}, w.options().dtype(dtype));
  return KernelSpectrum(wt.copy_(w.transpose(0, 1)), n);
}

// The frequency columns k1 in [k_begin, k_begin + count) of a whole spectrum [parts, n0 K, P, Q] (parts: 2, or
// 3 for a kept weight spectrum with its real minus imaginary part), as a view [parts, n0, count, P, Q] (not copied).
torch::Tensor spectrum_columns(const torch::Tensor& spec, int64_t n0, int64_t k_begin, int64_t count) {
  const int64_t K = spec.size(1) / n0;
  return spec.view({spec.size(0), n0, K, spec.size(2), spec.size(3)}).narrow(2, k_begin, count);
}

// A chunk's spectrum [2, n0 c, P, Q] as [2, n0, c, P, Q], the products' form.
torch::Tensor by_rows(const torch::Tensor& spec, int64_t n0) {
  return spec.view({2, n0, spec.size(1) / n0, spec.size(2), spec.size(3)});
}

// The fp32 scratch of a bf16 u's first stage, per piece of columns.
constexpr int64_t kInverseScratchBytes = int64_t{2} << 20;

// The inverse's first stage for the frequency columns [k_begin, k_begin + count) of a spectrum
// spec: [2, n0 count, P, Q]: u[:, columns (k1, PQ) of those k1] = M^-1 spec, u: [(i, part), (k1, PQ)]
// for positions step i, i < rows. Each column chunk writes its own part of u, once. A bf16 u (fp32 spec:
// the products' sums) gets the chunk through an fp32 scratch: oneDNN 2.6 builds no f32 x f32 -> bf16 product.
void first_axis_inverse_into(torch::Tensor& u, const torch::Tensor& spec, int64_t n0, int64_t step, int64_t rows,
                             int64_t k_begin) {
  const int64_t PQ = spec.size(2) * spec.size(3), count = spec.size(1) / n0;
  const auto m = complex_idft_matrix(n0, step, rows, spec.options());  // m: [(i, part), (part, k0)]
  const auto spec2d = spec.view({2 * n0, count * PQ});
  auto cols = u.narrow(1, k_begin * PQ, count * PQ);
  if (u.scalar_type() == spec.scalar_type()) return gemm_into(cols, m, spec2d);
  // The scratch holds a piece of the chunk's columns at a time (kInverseScratchBytes): the whole chunk's
  // would sit on top of the backward's peak (7.8 MB for PrimaryCaps' input gradient).
  const int64_t piece = std::max<int64_t>(1, kInverseScratchBytes / (cols.size(0) * spec.element_size()));
  auto scratch = torch::empty({cols.size(0), std::min(piece, cols.size(1))}, spec.options());
  for (int64_t j = 0; j < cols.size(1); j += piece) {
    const int64_t width = std::min(piece, cols.size(1) - j);
    auto part = scratch.narrow(1, 0, width);  // part: [2 rows, width]
    gemm_into(part, m, spec2d.narrow(1, j, width));
    cols.narrow(1, j, width).copy_(part);
  }
}

// The inverse's last stage, straight into out's rows: out[:, :, i, :count1] = u[i] iw, one batched product over
// the rows i, summing over (part, k1). u: [(i, part), (k1, PQ)], rows (part, k1) of a row i 2 K evenly spaced
// ones; out: [P, Q, >= count0, >= count1] contiguous, of u's dtype or fp32 for a bf16 u (bf16 x bf16 sums in
// fp32 either way).
void last_axis_inverse_into(torch::Tensor& out, const torch::Tensor& u, std::array<int64_t, 2> n, int64_t step,
                            std::array<int64_t, 2> count) {
  const int64_t PQ = out.size(0) * out.size(1), K = half_size(n[1]);
  const auto iw = real_idft_matrices(n[0], n[1], step, count[1], count[0], u.options());  // iw: [count0, 2 K, count1]
  const auto a = u.view({count[0], 2 * K, PQ}).transpose(1, 2);               // a: [count0, PQ, 2 K]
  // dst: [count0, PQ, count1], a view of out's rows
  auto dst = out.view({PQ, out.size(2), out.size(3)}).narrow(1, 0, count[0]).narrow(2, 0, count[1]).transpose(0, 1);
  batched_gemm_into(dst, a, iw, 1.0, 0.0);
}

// The complex products per frequency, with three real ones each (Gauss), over one chunk of frequency
// columns (the weight side's spectra exist one chunk at a time). Spectra are [2, n0, c, ., .] (real,
// imaginary; the first-axis frequencies k0; the chunk's columns k1), the input side's (x, dy) strided
// views of their whole spectrum, the Gauss sums [n0, c, ., .]. With T1 = (real x real) and
// T2 = (imaginary x imaginary) of the same transposes:
//   forward:         Y = X conj(W)^T   ->  Yr = T1 + T2, Yi = T3 - T1 + T2, T3 = (Xr + Xi)(Wr - Wi)^T
//   input gradient:  dX = dZ W          ->  dXr = T1 - T2, dXi = T1 + T2 - T3, T3 = (Dr - Di)(Wr - Wi)
//   weight gradient: dW = conj(dZ)^T X  ->  dWr = T1 + T2, dWi = T1 - T2 - T3, T3 = (Dr + Di)^T (Xr - Xi)
// T2 goes into the imaginary output first and T3 is accumulated last, so no scratch is needed.
// op(t) maps a [c, ., .] batch to the product's operand (a transpose or itself).

// a[0] + a[1] (sign +1) or a[0] - a[1] (sign -1) of a spectrum [2, ...], the Gauss products' third
// operand: over a[0] in place where a is the caller's own scratch whose real part is not read again (a
// chunk's spectrum made for this product: 5 MB of w's per fp32 column for PrimaryCaps), else new.
torch::Tensor combined_parts(const torch::Tensor& a, int sign, bool scratch) {
  auto re = a[0];
  if (scratch) return sign > 0 ? re.add_(a[1]) : re.sub_(a[1]);
  return sign > 0 ? re + a[1] : re - a[1];
}

// out [n0, c, ., .] = a b per frequency: one batched product over all of them (bf16: one oneDNN matmul; fp32:
// oneDNN's sgemm per matrix).
template <class OpA, class OpB>
void products_into(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, OpA op_a, OpB op_b,
                   double alpha, double beta) {
  batched_gemm_into(out, op_a(a), op_b(b), alpha, beta);
}

const auto as_is = [](const torch::Tensor& t) { return t; };
const auto transposed = [](const torch::Tensor& t) { return t.transpose(-2, -1); };

// ys = the forward's products. xs: [2, n0, c, B, C]; wts: the spectrum of w's transpose (W^T per frequency,
// conjugated by the formulas), [2, n0, c, C, O], or [3, ...] with Wr - Wi made once (a kept bf16 spectrum): sgemm
// ran [100, 256] x [256, 256] 1.28x slower with the right operand transposed (measured); ys: [2, n0, c, B, O].
// *_scratch: the operand is the caller's to overwrite.
void forward_products(torch::Tensor& ys, const torch::Tensor& xs, bool xs_scratch, const torch::Tensor& wts,
                      bool wts_scratch) {
  auto yr = ys[0], yi = ys[1];
  products_into(yr, xs[0], wts[0], as_is, as_is, 1.0, 0.0);                         // T1
  products_into(yi, xs[1], wts[1], as_is, as_is, 1.0, 0.0);                         // T2
  yr.add_(yi);                                                                       // T1 + T2
  yi.mul_(2).sub_(yr);                                                               // T2 - T1
  const auto xsum = combined_parts(xs, +1, xs_scratch);
  const auto wdiff = wts.size(0) == 3 ? wts[2] : combined_parts(wts, -1, wts_scratch);
  products_into(yi, xsum, wdiff, as_is, as_is, 1.0, 1.0);                           // + T3
}

// dxs = the input gradient's products. dz: [2, n0, c, B, O]; dxs: [2, n0, c, B, C].
// ws: W's spectrum [2, n0, c, O, C], or, where `transposed_w`, the forward's spectrum of w^T ([2, n0, c, C, O]:
// W^T's entries) read transposed. *_scratch: the operand may be overwritten.
void input_grad_products(torch::Tensor& dxs, const torch::Tensor& dz, bool dz_scratch, const torch::Tensor& ws,
                         bool transposed_w, bool ws_scratch) {
  const auto w_in = [&](torch::Tensor& out, const torch::Tensor& d, const torch::Tensor& w, double alpha, double beta) {
    if (transposed_w) return products_into(out, d, w, as_is, transposed, alpha, beta);
    products_into(out, d, w, as_is, as_is, alpha, beta);
  };
  auto dxr = dxs[0], dxi = dxs[1];
  w_in(dxr, dz[0], ws[0], 1.0, 0.0);                                                 // T1
  w_in(dxi, dz[1], ws[1], 1.0, 0.0);                                                 // T2
  dxr.sub_(dxi);                                                                     // T1 - T2
  dxi.mul_(2).add_(dxr);                                                             // T1 + T2
  const auto ddiff = combined_parts(dz, -1, dz_scratch), wdiff = combined_parts(ws, -1, ws_scratch);
  w_in(dxi, ddiff, wdiff, -1.0, 1.0);                                                // - T3
}

// dws = the weight gradient's products. dz: [2, n0, c, B, O] (the chunk's own, overwritten);
// xs: [2, n0, c, B, C] (read only); dws: [2, n0, c, O, C].
void weight_grad_products(torch::Tensor& dws, const torch::Tensor& dz, const torch::Tensor& xs) {
  auto dwr = dws[0], dwi = dws[1];
  products_into(dwr, dz[0], xs[0], transposed, as_is, 1.0, 0.0);                    // T1
  products_into(dwi, dz[1], xs[1], transposed, as_is, 1.0, 0.0);                    // T2
  dwr.add_(dwi);                                                                     // T1 + T2
  dwi.mul_(-2).add_(dwr);                                                            // T1 - T2
  const auto dsum = combined_parts(dz, +1, true), xdiff = combined_parts(xs, -1, false);
  products_into(dwi, dsum, xdiff, transposed, as_is, -1.0, 1.0);                    // - T3
}

// Frequency columns k1 per chunk: the most whose slice of the weight's spectrum ([2, n0 columns, O, C] in
// the spectra's dtype) fits chunk_bytes (at least one).
int64_t columns_per_chunk(int64_t n0, int64_t O, int64_t C, int64_t element_size, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(2 * n0 * O * C * element_size, 1));
}

// Whether the forward keeps w^T's whole spectrum for the input gradient instead of the backward making W's
// again: bf16 (PrimaryCaps: 50 MB kept, 8-9 ms of the step saved; docs/kernels.md), not fp32 (100 MB).
bool keeps_weight_spectrum(torch::ScalarType spectra) { return spectra == torch::kBFloat16; }

struct SpectralGeometry {
  std::array<int64_t, 2> stride, kernel, output, circle;  // circle: the DFT sizes Nh, Nw
};

SpectralGeometry geometry_for(std::array<int64_t, 2> input, std::array<int64_t, 2> kernel,
                              std::array<int64_t, 2> stride) {
  SpectralGeometry g{stride, kernel, {}, {}};
  for (int d = 0; d < 2; ++d) {
    g.output[d] = (input[d] - kernel[d]) / stride[d] + 1;
    g.circle[d] = circle_size(kernel[d], g.output[d], stride[d]);
  }
  return g;
}

SpectralGeometry spectral_geometry(const torch::Tensor& x, const torch::Tensor& w, std::array<int64_t, 2> stride) {
  TORCH_CHECK(x.dim() == 4 && w.dim() == 4 && x.size(1) == w.size(1),
              "conv2d_spectral: x [N, C, H, W] and w [O, C, K0, K1] must share C, got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(stride[0] >= 1 && stride[1] >= 1, "conv2d_spectral: stride must be positive");
  TORCH_CHECK(x.size(2) >= w.size(2) && x.size(3) >= w.size(3), "conv2d_spectral: the kernel ", w.sizes(),
              " is larger than the input ", x.sizes());
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  TORCH_CHECK((xt == wt && (xt == torch::kFloat || xt == torch::kDouble)) ||
                  (xt == torch::kBFloat16 && wt == torch::kFloat),
              "conv2d_spectral: x and w must both be float32 or float64, or x bfloat16 and w float32; got ", xt,
              " and ", wt);
  return geometry_for({x.size(2), x.size(3)}, {w.size(2), w.size(3)}, stride);
}

// y = the forward through DFTs (conv2d_spectral's) of N inputs, a chunk of `columns` frequency columns k1 at
// a time: x_columns(k1, c) gives x's spectrum for them ([2, n0, c, N, C], in `spectra` dtype) and
// weight_columns(k1, c) w^T's ([2, n0, c, C, O], the same dtype); *_scratch: whether those are made per
// chunk (the products may overwrite them) or views of a whole spectrum. The products' sums in `sums` (fp32
// accumulation), the inverse's first-stage buffer in the spectra's dtype (last_axis_inverse_into sums in fp32);
// y: [N, O, P, Q] in the spectra's dtype; b: [O] or undefined.
template <class XColumns, class WeightColumns>
torch::Tensor spectral_forward(int64_t N, const torch::TensorOptions& spectra, const torch::Tensor& b,
                               const SpectralGeometry& g, int64_t O, int64_t columns, const torch::TensorOptions& sums,
                               XColumns x_columns, bool x_scratch, WeightColumns weight_columns, bool w_scratch) {
  const int64_t n0 = g.circle[0], K = half_size(g.circle[1]);
  // The frequencies a chunk of columns k1 at a time: w's spectrum exists one chunk at a time, and each
  // chunk's inverse writes its own columns of u (the inverse's first stage) once.
  auto u = torch::empty({2 * g.output[0], K * N * O}, spectra);
  for (int64_t k1 = 0; k1 < K; k1 += columns) {
    const int64_t c = std::min(columns, K - k1);
    torch::Tensor wts, xc;
    {
      CAPSNET_PROFILE_SCOPE("spectral::forward.w_spectrum");
      wts = weight_columns(k1, c);  // wts: [2, n0, c, C, O]
    }
    {
      CAPSNET_PROFILE_SCOPE("spectral::forward.x_spectrum_columns");
      xc = x_columns(k1, c);  // xc: [2, n0, c, N, C]
    }
    auto ys = torch::empty({2, n0 * c, N, O}, sums);
    auto ys_rows = by_rows(ys, n0);
    {
      CAPSNET_PROFILE_SCOPE("spectral::forward.products");
      forward_products(ys_rows, xc, x_scratch, wts, w_scratch);
    }
    CAPSNET_PROFILE_SCOPE("spectral::forward.inverse");
    first_axis_inverse_into(u, ys, n0, g.stride[0], g.output[0], k1);
  }
  auto y = torch::empty({N, O, g.output[0], g.output[1]}, sums);
  {
    CAPSNET_PROFILE_SCOPE("spectral::forward.inverse_last");
    last_axis_inverse_into(y, u, g.circle, g.stride[1], g.output);
  }
  if (b.defined()) y.add_(b.view({1, -1, 1, 1}).to(y.scalar_type()));
  return y.to(spectra.dtype().toScalarType());  // no copy where the spectra are fp32
}

using detail::as_array;
using detail::as_vector;

// The spectrum of the x the convolution reads: its input, or relu(input) where the ReLU is fused (applied
// a row at a time inside the last-axis stage). Returns [2, F, N, C].
torch::Tensor input_spectrum(const torch::Tensor& input, bool relu_input, std::array<int64_t, 2> circle) {
  return two_stage_spectrum(input.contiguous(), circle, {1, 1}, circle, relu_input);
}

class SpectralConv2dFunction : public torch::autograd::Function<SpectralConv2dFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& w_in, const torch::Tensor& b, std::array<int64_t, 2> stride,
                               int64_t chunk_bytes, bool relu_input) {
    CAPSNET_PROFILE_SCOPE("spectral::forward");
    const auto w = w_in.contiguous();
    const auto g = spectral_geometry(input, w, stride);
    const int64_t C = input.size(1), O = w.size(0);
    // x's spectrum first: its last-axis stage is freed before w's (fp32: 47 MB) is made.
    torch::Tensor xs;  // xs: [2, F, N, C]
    {
      CAPSNET_PROFILE_SCOPE("spectral::forward.x_spectrum");
      xs = input_spectrum(input, relu_input, g.circle);
    }
    const auto wt_spectrum = [&] {
      CAPSNET_PROFILE_SCOPE("spectral::forward.w_spectrum");
      return transposed_kernel_spectrum(w, input.scalar_type(), g.circle);
    }();
    // bf16: w^T's whole spectrum (W^T per frequency) is made once here and kept for the input gradient
    // (PrimaryCaps: 50 MB, made in 9-10 ms); fp32 makes it a chunk at a time, here and again in the backward
    // (whole: 100 MB).
    const bool keep_w = keeps_weight_spectrum(input.scalar_type());
    torch::Tensor w_kept;  // w_kept: [2, n0 K, C, O]
    if (keep_w) {
      CAPSNET_PROFILE_SCOPE("spectral::forward.w_spectrum");
      w_kept = wt_spectrum.columns(0, half_size(g.circle[1]));
    }
    const auto y = spectral_forward(
        input.size(0), xs.options(), b, g, O, columns_per_chunk(g.circle[0], O, C, input.element_size(), chunk_bytes),
        w.options(), [&](int64_t k1, int64_t c) { return spectrum_columns(xs, g.circle[0], k1, c); }, false,
        [&](int64_t k1, int64_t c) {
          return keep_w ? spectrum_columns(w_kept, g.circle[0], k1, c)
                        : by_rows(wt_spectrum.columns(k1, c), g.circle[0]);
        },
        !keep_w);
    // The backward needs x through its spectrum (about x's size), kept apart so that the backward can free
    // it once the weight gradient is done. The input is kept too, outside the saved variables, so that the
    // backward can let it go as soon as it has what it needs (ReLU's sign bits; nothing without ReLU)
    // unless the graph is kept for another backward, which makes x's spectrum from it again: PrimaryCaps'
    // input (bf16: 20.5 MB, fp32: 41) no longer sits on the backward's peak. Its version is checked as a
    // saved variable's would be. w's spectrum is kept (bf16) or made again in the backward (fp32, fp64).
    ctx->save_for_backward({w});
    ctx->saved_data["input"] = input;
    ctx->saved_data["input_version"] = static_cast<int64_t>(input._version());
    ctx->saved_data["relu_input"] = relu_input;
    ctx->saved_data["x_spectrum"] = xs;
    if (keep_w) ctx->saved_data["w_spectrum"] = w_kept;
    ctx->saved_data["stride"] = as_vector(stride);
    ctx->saved_data["chunk_bytes"] = chunk_bytes;
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    CAPSNET_PROFILE_SCOPE("spectral::backward");
    const auto w = ctx->get_saved_variables()[0];
    // create_graph: the gradient would be built from kernels autograd cannot see through, so
    // differentiating it again would be silently wrong. Refused, as the registered ops refuse it.
    TORCH_CHECK(!torch::GradMode::is_enabled(), "conv2d_spectral: double backward (create_graph, "
                "differentiating the gradient) is not implemented");
    auto input = ctx->saved_data["input"].toTensor();
    TORCH_CHECK(input._version() == ctx->saved_data["input_version"].toInt(),
                "conv2d_spectral: its input was modified by an in-place operation after the forward; the "
                "backward needs it as it was");
    const bool relu_input = ctx->saved_data["relu_input"].toBool();
    const auto stride = as_array(ctx->saved_data["stride"]);
    const std::array<int64_t, 2> input_size{input.size(2), input.size(3)};
    const auto input_options = input.options();
    const auto dy = grads[0].contiguous();  // dy: [N, O, P, Q]
    const int64_t N = dy.size(0), O = w.size(0), C = w.size(1);
    const std::array<int64_t, 2> kernel{w.size(2), w.size(3)}, output{dy.size(2), dy.size(3)};
    const std::array<int64_t, 2> circle{circle_size(kernel[0], output[0], stride[0]),
                                        circle_size(kernel[1], output[1], stride[1])};
    const int64_t n0 = circle[0], K = half_size(circle[1]);
    // The spectra in the input's dtype, sums in w's (see forward).
    const auto spectrum_dtype = input.scalar_type();
    const auto sums = w.options(), spectra = dy.options().dtype(spectrum_dtype);
    const int64_t columns = columns_per_chunk(n0, O, C, input.element_size(), ctx->saved_data["chunk_bytes"].toInt());
    torch::Tensor xs;  // xs: [2, F, N, C], taken from the forward (or made again: a second backward)
    if (ctx->saved_data.count("x_spectrum") != 0) {
      xs = ctx->saved_data["x_spectrum"].toTensor();
      ctx->saved_data.erase("x_spectrum");
    } else if (ctx->needs_input_grad(1)) {
      xs = input_spectrum(input, relu_input, circle);
    }
    // w^T's spectrum kept by the forward (bf16; W^T per frequency), taken as x's is: a second backward makes
    // W's instead.
    torch::Tensor w_kept;  // w_kept: [2, F, C, O]
    if (ctx->saved_data.count("w_spectrum") != 0) {
      w_kept = ctx->saved_data["w_spectrum"].toTensor();
      ctx->saved_data.erase("w_spectrum");
    }
    const bool dx_first = w_kept.defined();
    // ReLU's backward needs only the input's signs: one bit each.
    const auto positive = [&] {
      CAPSNET_PROFILE_SCOPE("spectral::backward.relu_mask");
      return relu_input && ctx->needs_input_grad(0) ? positive_bits(input) : torch::Tensor();
    }();
    if (!torch::autograd::get_current_graph_task_keep_graph()) {
      ctx->saved_data.erase("input");  // nothing else reads it: let it go before the two loops
      input = torch::Tensor();
    }
    // dy sits at the strided positions of the full correlation's output. Its spectrum is made a chunk of
    // columns at a time from the last-axis stage (both loops make it: a first-axis product of `output[0]`
    // terms, where the whole spectrum would sit on the peak: 19.5 MB bf16 for PrimaryCaps, 3.9 per chunk).
    auto dy_last_axis = [&] {
      CAPSNET_PROFILE_SCOPE("spectral::backward.dy_spectrum");
      return last_axis_spectrum(dy.to(spectrum_dtype), circle[1], stride[1], output);
    }();
    // Where dx goes first (bf16), dy's whole spectrum is made once for both loops (PrimaryCaps: 19.5 MB bf16,
    // against two first-axis passes); the weight gradient, its last reader, overwrites it.
    torch::Tensor dz_whole;  // dz_whole: [2, F, N, O]
    if (dx_first && ctx->needs_input_grad(0) && ctx->needs_input_grad(1)) {
      CAPSNET_PROFILE_SCOPE("spectral::backward.dy_spectrum");
      dz_whole = first_axis_spectrum(dy_last_axis, n0, stride[0], 0, K, N, O);
      dy_last_axis = torch::Tensor();
    }
    const auto dz_columns = [&](int64_t k1, int64_t c) {  // [2, n0, c, N, O]
      CAPSNET_PROFILE_SCOPE("spectral::backward.dy_spectrum");
      if (dz_whole.defined()) return spectrum_columns(dz_whole, n0, k1, c);
      return by_rows(first_axis_spectrum(dy_last_axis, n0, stride[0], k1, c, N, O), n0);
    };
    torch::Tensor dx, dw, db;
    // Each loop's operands go before its last stage makes the gradient: the input gradient's last stage
    // would otherwise hold w's last-axis stage and dy's (fp32 PrimaryCaps: 47 + 12 MB) beside u and dx.
    const auto input_gradient = [&] {
      auto u = torch::empty({2 * n0, K * N * C}, spectra);
      {
        const bool kept = w_kept.defined();
        std::optional<KernelSpectrum> w_spectrum;  // W's, where the forward's w^T spectrum was not kept
        if (!kept) {
          CAPSNET_PROFILE_SCOPE("spectral::input_grad.w_spectrum");
          w_spectrum.emplace(w.to(spectrum_dtype), circle);
        }
        for (int64_t k1 = 0; k1 < K; k1 += columns) {
          const int64_t c = std::min(columns, K - k1);
          torch::Tensor ws;  // ws: [2, n0, c, O, C], or w^T's [2, n0, c, C, O] where kept
          {
            CAPSNET_PROFILE_SCOPE("spectral::input_grad.w_spectrum");
            ws = kept ? spectrum_columns(w_kept, n0, k1, c) : by_rows(w_spectrum->columns(k1, c), n0);
          }
          const auto dzc = dz_columns(k1, c);
          auto dxs = torch::empty({2, n0 * c, N, C}, sums);
          auto dxs_rows = by_rows(dxs, n0);
          {
            CAPSNET_PROFILE_SCOPE("spectral::input_grad.products");
            // Each chunk of w_kept is read once: ours to overwrite; dz_whole is read again by dW.
            input_grad_products(dxs_rows, dzc, !dz_whole.defined(), ws, kept, true);
          }
          CAPSNET_PROFILE_SCOPE("spectral::input_grad.inverse");
          first_axis_inverse_into(u, dxs, n0, 1, n0, k1);
        }
        w_kept = torch::Tensor();
      }
      CAPSNET_PROFILE_SCOPE("spectral::input_grad.inverse_last");
      if (!dx_first) dy_last_axis = torch::Tensor();  // the input gradient's loop runs last
      dx = torch::empty({N, C, input_size[0], input_size[1]}, input_options);
      // Rows and columns past the circle were never read: zero gradient.
      dx.narrow(2, circle[0], input_size[0] - circle[0]).zero_();
      dx.narrow(3, circle[1], input_size[1] - circle[1]).zero_();
      last_axis_inverse_into(dx, u, circle, 1, circle);
      if (relu_input) keep_where_positive_(dx, positive);
    };
    const auto weight_gradient = [&] {
      auto u = torch::empty({2 * kernel[0], K * O * C}, spectra);
      for (int64_t k1 = 0; k1 < K; k1 += columns) {
        const int64_t c = std::min(columns, K - k1);
        const auto dzc = dz_columns(k1, c), xc = spectrum_columns(xs, n0, k1, c);
        auto dws = torch::empty({2, n0 * c, O, C}, sums);
        auto dws_rows = by_rows(dws, n0);
        {
          CAPSNET_PROFILE_SCOPE("spectral::weight_grad.products");
          weight_grad_products(dws_rows, dzc, xc);
        }
        CAPSNET_PROFILE_SCOPE("spectral::weight_grad.inverse");
        first_axis_inverse_into(u, dws, n0, 1, kernel[0], k1);
      }
      xs = torch::Tensor();
      if (dx_first) dy_last_axis = dz_whole = torch::Tensor();
      CAPSNET_PROFILE_SCOPE("spectral::weight_grad.inverse_last");
      dw = torch::empty(w.sizes(), w.options());
      last_axis_inverse_into(dw, u, circle, 1, kernel);
    };
    // dW first, then x's spectrum goes, then dx (whose buffers are the larger). Measured (bench peak,
    // batch 100, 24 MB chunks): fp32 611 MB dx first against 639 dW first while x's spectrum stayed, 602
    // this way; bf16 521 against 509, and 509. Where the forward kept w's spectrum (bf16), dx first, so
    // that the kept spectrum (PrimaryCaps: 50 MB) goes before dW's buffers are made.
    if (dx_first) {
      if (ctx->needs_input_grad(0)) input_gradient();
      if (ctx->needs_input_grad(1)) weight_gradient();
    } else {
      if (ctx->needs_input_grad(1)) weight_gradient();
      xs = torch::Tensor();
      if (ctx->needs_input_grad(0)) input_gradient();
    }
    if (ctx->needs_input_grad(2)) db = dy.to(w.scalar_type()).sum({0, 2, 3});
    return {dx, dw, db, torch::Tensor(), torch::Tensor(), torch::Tensor()};
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
  return two_stage_spectrum(t, n, step, used, false);
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
  first_axis_inverse_into(u, spec, n[0], step[0], count[0], 0);
  last_axis_inverse_into(out, u, n, step[1], count);
}

torch::Tensor conv2d_spectral_weight_spectrum(const torch::Tensor& w, std::array<int64_t, 2> input_size,
                                              std::array<int64_t, 2> stride, torch::ScalarType dtype) {
  // A stand-in input of the right shape and dtype checks the geometry as conv2d_spectral would.
  const auto probe = torch::empty({0, w.size(1), input_size[0], input_size[1]}, w.options().dtype(dtype));
  const auto g = spectral_geometry(probe, w, stride);
  const int64_t K = half_size(g.circle[1]);
  if (dtype != torch::kBFloat16) return transposed_kernel_spectrum(w, dtype, g.circle).columns(0, K);  // [2, n0 K, C, O]
  // bf16: the forward's third Gauss operand Wr - Wi kept too, in the bf16 the per-call subtraction rounds to
  // (PrimaryCaps: 25 MB more kept, 1.8 ms less per call at batch 100 on a 2-core Zen 5; docs/kernels.md), all
  // three written into one buffer: a concatenation would hold the two parts and the difference beside it
  // (PrimaryCaps: 48 + 24 MB above the 72 MB kept, at every epoch-end evaluation).
  auto spec = torch::empty({3, g.circle[0] * K, w.size(1), w.size(0)}, w.options().dtype(dtype));  // [3, n0 K, C, O]
  transposed_kernel_spectrum(w, dtype, g.circle).columns_into(spec.narrow(0, 0, 2), 0, K);
  auto difference = spec[2];
  at::sub_out(difference, spec[0], spec[1]);
  return spec;
}

torch::Tensor conv2d_spectral_inference(torch::Tensor x, const torch::Tensor& w_spectrum,
                                        const torch::Tensor& b, std::array<int64_t, 2> kernel,
                                        std::array<int64_t, 2> stride, int64_t chunk_bytes, bool relu_input) {
  TORCH_CHECK(!torch::GradMode::is_enabled() || !x.requires_grad(),
              "conv2d_spectral_inference: no gradients through a kept weight spectrum; use conv2d_spectral");
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu() && w_spectrum.dim() == 4 &&
                  (w_spectrum.size(0) == 2 || w_spectrum.size(0) == 3) &&
                  w_spectrum.size(2) == x.size(1) && x.scalar_type() == w_spectrum.scalar_type(),
              "conv2d_spectral_inference: x [N, C, H, W] and a weight spectrum [2 or 3, F, C, O] of x's dtype, got ",
              x.sizes(), " ", x.scalar_type(), " and ", w_spectrum.sizes(), " ", w_spectrum.scalar_type());
  TORCH_CHECK(stride[0] >= 1 && stride[1] >= 1 && kernel[0] >= 1 && kernel[1] >= 1 && x.size(2) >= kernel[0] &&
                  x.size(3) >= kernel[1],
              "conv2d_spectral_inference: stride and kernel must be positive and the kernel no larger than the input");
  x = x.contiguous();
  // An x that nothing else holds (moved in, as conv2d_at does with Conv1's output) takes the ReLU in place: one
  // contiguous pass, 4x cheaper than a strided one per row inside the last-axis stage (bf16 at batch 100 on a
  // 2-core Zen 5: ~0.8 against ~3 ms); anyone else's x is left as it is.
  if (relu_input && x.use_count() == 1 && x.storage().use_count() == 1) {
    x.relu_();
    relu_input = false;
  }
  const auto g = geometry_for({x.size(2), x.size(3)}, kernel, stride);
  const int64_t C = x.size(1), O = w_spectrum.size(3), n0 = g.circle[0];
  TORCH_CHECK(w_spectrum.size(1) == n0 * half_size(g.circle[1]),
              "conv2d_spectral_inference: the weight spectrum was made for another input size or kernel");
  const auto sums = x.options().dtype(x.scalar_type() == torch::kBFloat16 ? torch::kFloat : x.scalar_type());
  // x's spectrum a chunk of columns at a time from its last-axis stage: nothing keeps it for a backward, and
  // the whole of it would sit beside that stage (each about x's size: 49 MB each for bf16 at batch 250).
  const auto x_last_axis = last_axis_spectrum(x, g.circle[1], 1, g.circle, relu_input);  // [circle0, 2 K, N C]
  const int64_t N = x.size(0), element_size = x.element_size();
  const auto spectra = x.options();
  x = torch::Tensor();  // the products read x's last-axis stage only (a caller that moved x in frees it here)
  return spectral_forward(
      N, spectra, b, g, O, columns_per_chunk(n0, O, C, element_size, chunk_bytes), sums,
      [&](int64_t k1, int64_t c) { return by_rows(first_axis_spectrum(x_last_axis, n0, 1, k1, c, N, C), n0); }, true,
      [&](int64_t k1, int64_t c) { return spectrum_columns(w_spectrum, n0, k1, c); }, false);
}

namespace {
torch::Tensor apply_spectral_conv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                  std::array<int64_t, 2> stride, int64_t chunk_bytes, bool relu_input) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && !x.is_mkldnn(), "conv2d_spectral: dense CPU tensors only");
  // Custom autograd functions take no undefined inputs: a missing bias is a zero one that needs no gradient.
  return SpectralConv2dFunction::apply(x, w, b.defined() ? b : torch::zeros({w.size(0)}, w.options()), stride,
                                       chunk_bytes, relu_input);
}
}  // namespace

torch::Tensor conv2d_spectral(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                              std::array<int64_t, 2> stride, int64_t chunk_bytes) {
  return apply_spectral_conv(x, w, b, stride, chunk_bytes, false);
}

torch::Tensor conv2d_spectral_relu(const torch::Tensor& z, const torch::Tensor& w, const torch::Tensor& b,
                                   std::array<int64_t, 2> stride, int64_t chunk_bytes) {
  return apply_spectral_conv(z, w, b, stride, chunk_bytes, true);
}

}  // namespace capsnet::kernels
