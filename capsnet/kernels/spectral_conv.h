#pragma once
// A strided 2-D convolution (zero padding, dilation 1, groups 1) computed through discrete Fourier
// transforms, with the transforms and the per-frequency channel mixing all as matrix products.
//
// The output (P x Q at stride s) reads rows [0, Nh) and columns [0, Nw) of x, Nh = s0 (P - 1) + K0,
// Nw = s1 (Q - 1) + K1. On an Nh x Nw circle no read wraps, so the correlation is exact there:
//
//   Y[f] = sum_c X[f, c] conj(W[f, o, c])           y = the inverse DFT of Y at rows s0 i, columns s1 j
//
// and its gradients are products of spectra too (dy placed at the strided positions: dZ):
//
//   dX[f] = sum_o dZ[f, o] W[f, o, c]                dW[f] = sum_n conj(dZ[n, f, o]) X[n, f, c]
//
// Each is one complex product per frequency f (Nh x (Nw/2 + 1) of them, real inputs), done with three
// real products (Gauss) by oneDNN's sgemm in fp32 (kernels/gemm.h). With a bf16 input (and the fp32 master
// weight) the spectra and the products' operands are bf16 (oneDNN's matmul, sums in fp32), the inverse's
// first stage fp32 into a bf16 buffer, its last stage a bf16 product summing in fp32: y and dx come back in
// bf16, dW and db in fp32 (no bf16 weight gradient).
// Why: PrimaryCaps (256 -> 256, 9 x 9, stride 2, 20 x 20 -> 6 x 6) costs 81 x 36 = 2916 multiply-adds
// per (example, in, out) channel directly, 3 x 19 x 10 = 570 this way: at batch 100 its fp32 forward
// took 82-100 ms against 148-164 ms in oneDNN's direct kernels, both gradients 126-141 ms against ~300;
// with the frequencies in chunks of columns, forward + backward 154-157 ms against 183-187 before; in
// bf16 97-106 ms, against 144-159 in fp32 and ~144 for oneDNN's bf16 kernels (docs/kernels.md,
// "Spectral convolution for PrimaryCaps").
// The DFTs are matrix products too (the sizes are small and not powers of two, where PyTorch 1.13's
// pocketfft was measured 0.2 s for the input's rfft2 alone). Rounding: the transforms are orthogonal up
// to scale, so fp32 errors stay ~1e-6 of the output's norm; bf16's 3-6e-3 of the largest entry, against
// ~2.5e-3 for oneDNN's direct bf16 convolution (tests/unit/kernels/test_spectral_conv.cpp).

#include <torch/torch.h>

#include <array>

namespace capsnet::kernels {

/// Whether conv2d_spectral needs fewer multiply-adds than a direct convolution by a clear margin
/// (at least 3x fewer per channel pair) for this kernel and output size.
bool spectral_conv_pays_off(std::array<int64_t, 2> kernel, std::array<int64_t, 2> output,
                            std::array<int64_t, 2> stride);

/// Bytes of the weight's spectrum held at a time, in the spectra's dtype: conv2d_spectral goes through the
/// frequencies in chunks of whole columns (the last axis's frequencies; PrimaryCaps' whole spectrum,
/// 2 x 19 x 10 x 256 x 256 values, is 100 MB in fp32; a column 10 MB in fp32, 5 MB in bf16, so chunks of
/// one column in both). One bf16 column against two (12 MB), measured at batch 100 with w's spectrum kept
/// by the forward and one product per pass (Zen 5, alternated twice): PrimaryCaps' bf16 step 90-93 -> 80-82
/// ms, training 800 -> 934 img/s (each chunk's sums are still in cache when the inverse reads them), peak
/// 371 -> 401 MB; fp32 unchanged (one column either way).
constexpr int64_t kSpectralChunkBytes = int64_t{5} << 20;

/// y = conv2d(x, w, b, stride) through DFTs, differentiable in x, w and b (b may be undefined).
/// x: [N, C, H, W]; w: [O, C, K0, K1]; b: [O]; CPU; x, w and b float32 or float64, or x bfloat16 with w
/// and b float32 (bf16 spectra and products, fp32 sums). Returns y: [N, O, P, Q] in x's dtype; the
/// gradients come back in their input's dtype.
/// chunk_bytes: at most this many bytes of w's spectrum at a time (at least one column of frequencies).
torch::Tensor conv2d_spectral(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                              std::array<int64_t, 2> stride, int64_t chunk_bytes = kSpectralChunkBytes);

/// conv2d_spectral(relu(z), w, b, stride) with the ReLU fused: its backward keeps z's signs as one bit per
/// element (kernels/sign_mask.h) and lets z go before its two loops, where relu(z) would otherwise be held by
/// ReLU's backward and this one's (PrimaryCaps after Conv1: 20.5 MB in bf16, 41 in fp32, off the loops).
/// With the graph kept (retain_graph) z is kept too: a second backward makes relu(z)'s spectrum from it.
torch::Tensor conv2d_spectral_relu(const torch::Tensor& z, const torch::Tensor& w, const torch::Tensor& b,
                                   std::array<int64_t, 2> stride, int64_t chunk_bytes = kSpectralChunkBytes);

/// w^T's spectrum as conv2d_spectral's forward multiplies with it, all frequencies at once, for callers that
/// keep it across inference calls while w is unchanged (kernels::BlockedConvWeights): it saves making it per
/// call (~12 ms fp32, ~8 ms bf16 for PrimaryCaps) at the cost of holding it (PrimaryCaps: 100 MB fp32, 75 MB
/// bf16 with its third part). w: [O, C, K0, K1] (float32, or float64 with dtype float64); dtype: the input's (float32,
/// float64, bfloat16); input_size: H, W. Returns [2 (real, imaginary), n0 (n1 / 2 + 1), C, O] in dtype; for
/// bfloat16 [3, ...], the third part real minus imaginary (the forward's third Gauss operand, made once).
torch::Tensor conv2d_spectral_weight_spectrum(const torch::Tensor& w, std::array<int64_t, 2> input_size,
                                              std::array<int64_t, 2> stride, torch::ScalarType dtype);

/// conv2d_spectral's forward with a kept weight spectrum (above), without autograd: x [N, C, H, W] in the
/// spectrum's dtype, b: [O] (fp32 / fp64) or undefined, kernel: K0, K1. Returns y: [N, O, P, Q] in x's dtype.
/// x by value: a moved-in x goes once its last-axis stage is made, before the products. relu_input: convolve
/// relu(x): in place where nothing else holds x (use_count 1, its storage's too), else a row at a time inside
/// that stage (no copy of the whole of x); the caller's x is never changed.
torch::Tensor conv2d_spectral_inference(torch::Tensor x, const torch::Tensor& w_spectrum, const torch::Tensor& b,
                                        std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                                        int64_t chunk_bytes = kSpectralChunkBytes, bool relu_input = false);

/// The building blocks (exposed for the tests).
/// spectrum of t: [P, Q, R, S] (contiguous) on an n[0] x n[1] circle, sample (r, s) of t placed at
/// (step[0] r, step[1] s) for r < used[0], s < used[1]: [2 (real, imaginary), n0 * (n1 / 2 + 1), P, Q].
torch::Tensor real_spectrum(const torch::Tensor& t, std::array<int64_t, 2> n, std::array<int64_t, 2> step,
                            std::array<int64_t, 2> used);

/// The inverse: writes the real signal of spec [2, n0 * (n1 / 2 + 1), P, Q] at positions (step[0] i,
/// step[1] j) into out[p, q, i, j] for i < count[0], j < count[1]. out: [P, Q, >= count[0], >= count[1]]
/// (contiguous); other entries are left as they are.
void inverse_real_spectrum_into(torch::Tensor& out, const torch::Tensor& spec, std::array<int64_t, 2> n,
                                std::array<int64_t, 2> step, std::array<int64_t, 2> count);

}  // namespace capsnet::kernels
