#!/usr/bin/python3
"""The spectral plain-PyTorch peer: bench/peer_tuned.py's CapsNet with PrimaryCaps computed the way capsnet's
C++ spectral convolution computes it (capsnet/kernels/spectral_conv.h, docs/kernels.md "Spectral convolution
for PrimaryCaps"), in Python and plain PyTorch 1.13 only (issue 45), so that `capsnet bench` compares the
C++ kernels with the same algorithm written as well as we can in eager PyTorch, not only with oneDNN's
direct convolution.

Everything but PrimaryCaps is peer_tuned.py's, imported from it (network, routing Function, loss, malloc
tuning, RSS reporting); the command line and the JSON line are peer_tuned.py's too, with "config"
peer-spectral / peer-spectral-bf16.

PrimaryCaps (256 -> 256 channels, 9x9, stride 2, 20x20 -> 6x6) through discrete Fourier transforms:
  * the output reads rows and columns [0, 19) of x (2 * 5 + 9 = 19); on a 19 x 19 circle no read wraps, so
    the strided correlation is exact there: Y[f] = sum_c X[f, c] conj(W[f, o, c]) for the 19 x 10 = 190
    frequencies f of a real signal, and y is the inverse transform sampled at the even positions.
    Per (example, in, out) channel: 3 x 190 = 570 real multiply-adds against 81 x 36 = 2916 directly (5.1x).
    (Splitting x into its 4 stride phases, 10 x 10 each with 5x5 / 5x4 / 4x5 / 4x4 sub-kernels, gives
    4 x 10 x 6 = 240 complex products per channel pair instead of 190: the single 19 x 19 circle is cheaper
    and is what the C++ does.)
  * the gradients are products of spectra too, with dy placed at the strided positions (its spectrum dZ):
    dX[f] = dZ[f] W[f] (the input gradient, 19 x 19 circle, read back at every position) and
    dW[f] = conj(dZ[f])^T X[f] (the weight gradient, read back at the 9 x 9 kernel positions);
  * the DFTs are matrix products, two stages each: along the last axis one small product per sample row,
    then ONE product over (row, real/imaginary part) for the first axis. Not torch.fft: its rfft2 of x
    alone (19 x 19, batch 100) took 49 ms against 44 ms for these products making all three planes below
    in the layout the channel products read (1 thread, loaded machine), and it has no bf16;
  * each complex product is three real products (Gauss): with the planes X' = Xr - Xi, W' = Wr + Wi and
    dZ' = dZr + dZi, each of the three passes is ONE torch.bmm over 3 x 190 frequency planes:
        forward  [Xr, Xi, X'] x [Wr, Wi, W']      -> Yr = T1 + T2,  Yi = T1 - T2 - T3
        dx       [Dr, Di, D'] x [Wr, Wi, W']^T    -> dXr = T1 - T2, dXi = T3 - T1 - T2
        dw       [Dr, Di, D']^T x [Xr, Xi, X']    -> dWr = T1 + T2, dWi = T1 - T2 - T3
    The third plane of every spectrum comes out of the same first-axis DFT product (3 x 19 output rows),
    and the recombinations above are folded into the inverse's first-axis matrix, so no elementwise pass
    touches the spectra at all;
  * the weight's spectrum (of w^T: [C, O] per frequency, the forward's operand untransposed) is made once
    per training step, in the forward, and reused by the input gradient; x's spectrum is kept from the
    forward for the weight gradient; a custom torch.autograd.Function with a hand-written backward;
  * the inverse's last stage writes each output row straight into y / dx / dw (strided GEMM outputs), so
    the results come out in NCHW / OIHW without a copy;
  * inference (no autograd) from batch 32 on keeps w's spectrum between calls while w is unchanged (its
    version counter), as the C++ does; below batch 32 (latency at batch 1) F.conv2d, the direct kernel.
--precision bf16: peer_tuned.py's autocast, with PrimaryCaps' spectra and all three products in bf16
(oneDNN's bf16 GEMMs, fp32 accumulation inside each product; torch 1.13 has no bf16 x bf16 -> fp32 matmul,
so the products' results are rounded to bf16 before the Gauss recombination). w's spectrum is one bf16
product with the 2-D DFT matrix of the 9x9 kernel; y, the weight gradient and the bias gradient come out
in fp32 (the inverse's last stage in fp32), dx in bf16 (x's dtype). The master weights stay fp32.

Prints one JSON line with the same fields as peer_tuned.py.
Runnable alone:  /usr/bin/python3 bench/peer_spectral.py --steps 5 [--precision bf16]
Correctness:     /usr/bin/python3 bench/peer_spectral.py --check   (PASS/FAIL; float64 against F.conv2d and
                 autograd, gradcheck, bf16 against fp32, the whole network against peer_tuned.py)
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_tuned  # noqa: E402  (the rest of the network, the loss and the reporting helpers)
from peer_tuned import loss_fn  # noqa: E402

SPECTRAL_INFER_MIN_BATCH = 32   # inference below this batch runs F.conv2d (the C++'s kSpectralInferenceMinBatch)

# Gauss recombinations (rows: real, imaginary; columns: the products T1, T2, T3), see the docstring.
_L_FORWARD = ((1.0, 1.0, 0.0), (1.0, -1.0, -1.0))
_L_INPUT_GRAD = ((1.0, -1.0, 0.0), (-1.0, -1.0, 1.0))
_L_WEIGHT_GRAD = ((1.0, 1.0, 0.0), (1.0, -1.0, -1.0))
# The third plane of each spectrum: Xr + sigma Xi.
_SIGMA_X, _SIGMA_W, _SIGMA_DZ = -1.0, 1.0, 1.0


def _half(n):
    return n // 2 + 1


def _angles(frequencies, samples, step, n):
    """2 pi (k * step * r mod n) / n in float64, [frequencies, samples] (the reduction keeps them exact)."""
    k = torch.arange(frequencies, dtype=torch.float64).unsqueeze(1)
    r = torch.arange(samples, dtype=torch.float64).unsqueeze(0) * step
    return torch.remainder(k * r, n) * (2 * math.pi / n)


_MATRICES = {}


def _cached(key, make, dtype):
    k = key + (dtype,)
    m = _MATRICES.get(k)
    if m is None:
        m = _MATRICES[k] = make().to(dtype).contiguous()
    return m


def _last_axis_dft(n, step, used, dtype):
    """Real DFT along the last axis: [2 K, used], rows (part, k) (cos, -sin), K = n // 2 + 1."""
    def make():
        a = _angles(_half(n), used, step, n)
        return torch.cat([torch.cos(a), -torch.sin(a)], 0)
    return _cached(("last", n, step, used), make, dtype)


def _first_axis_dft3(n, step, used, sigma, dtype):
    """Complex DFT along the first axis, rows (plane, k0) for the planes re, im, re + sigma im; columns
    (r, part) for r < used: [3 n, 2 used]. X = sum_r A[r] e^{-i a}: Xr = c Ar + s Ai, Xi = c Ai - s Ar."""
    def make():
        a = _angles(n, used, step, n)
        c, s = torch.cos(a), torch.sin(a)
        m = torch.empty(3, n, used, 2, dtype=torch.float64)
        m[0, :, :, 0], m[0, :, :, 1] = c, s
        m[1, :, :, 0], m[1, :, :, 1] = -s, c
        m[2, :, :, 0], m[2, :, :, 1] = c - sigma * s, s + sigma * c
        return m.reshape(3 * n, 2 * used)
    return _cached(("first3", n, step, used, sigma), make, dtype)


def _kernel_dft3(n, kernel, sigma, dtype):
    """2-D DFT of a K0 x K1 kernel (step 1) on the n0 x n1 circle: rows (plane, k0, k1) for the planes
    re, im, re + sigma im; columns (r, s): [3 n0 K, K0 K1]."""
    def make():
        a0 = _angles(n[0], kernel[0], 1, n[0])                          # [n0, K0]
        a1 = _angles(_half(n[1]), kernel[1], 1, n[1])                   # [K, K1]
        a = (a0.view(n[0], 1, kernel[0], 1) + a1.view(1, -1, 1, kernel[1])).reshape(-1, kernel[0] * kernel[1])
        c, s = torch.cos(a), -torch.sin(a)                              # e^{-i a}
        return torch.cat([c, s, c + sigma * s], 0)
    return _cached(("kernel3", n, kernel, sigma), make, dtype)


def _inverse_first_axis(n0, step, count, L, dtype):
    """The inverse along the first axis at positions step * i (i < count), of V = L (T1, T2, T3):
    rows (i, part), columns (product, k0): [2 count, 3 n0]. u = sum_k0 V[k0] e^{+i a}."""
    def make():
        a = _angles(n0, count, step, n0).t()                            # [count, n0]
        c, s = torch.cos(a), torch.sin(a)
        m = torch.empty(count, 2, 2, n0, dtype=torch.float64)          # [i, out part, in part, k0]
        m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1] = c, -s, s, c
        Lm = torch.tensor(L, dtype=torch.float64)                       # [in part, product]
        return torch.einsum("iopk,pt->iotk", m, Lm).reshape(2 * count, 3 * n0)
    return _cached(("ifirst", n0, step, count, L), make, dtype)


def _inverse_last_axis(n0, n1, step, count, dtype):
    """The inverse along the last axis to real samples at step * j (j < count), with the 1 / (n0 n1) of
    the 2-D inverse and the half spectrum's weights: [2 K, count], rows (part, k1)."""
    def make():
        K = _half(n1)
        w = torch.full((K, 1), 2.0 / (n0 * n1), dtype=torch.float64)
        w[0] = 1.0 / (n0 * n1)
        if n1 % 2 == 0:
            w[K - 1] = 1.0 / (n0 * n1)
        a = _angles(K, count, step, n1)
        return torch.cat([w * torch.cos(a), -w * torch.sin(a)], 0)
    return _cached(("ilast", n0, n1, step, count), make, dtype)


def spectrum3(t, n, step, used, sigma):
    """Spectrum of t [P, Q, R, S] (contiguous) on the n0 x n1 circle, sample (r, s) at (step0 r, step1 s)
    for r < used0, s < used1, in t's dtype: [3 (re, im, re + sigma im), n0 K, P, Q]."""
    P, Q, R, S = t.shape
    K = _half(n[1])
    m1 = _last_axis_dft(n[1], step[1], used[1], t.dtype)                 # [2 K, used1]
    tv = t.view(P * Q, R, S)
    a = torch.empty(used[0], 2 * K, P * Q, dtype=t.dtype)                # [r, (part, k1), PQ]
    for r in range(used[0]):                                             # t's row r read in place (transposed)
        torch.mm(m1, tv[:, r, :used[1]].t(), out=a[r])
    m0 = _first_axis_dft3(n[0], step[0], used[0], sigma, t.dtype)        # [3 n0, (r, part)]
    return torch.mm(m0, a.view(2 * used[0], K * P * Q)).view(3, n[0] * K, P, Q)


def weight_spectrum3(w, n, dtype):
    """The spectrum of w^T's planes ([C, O] per frequency), [3, F, C, O] in dtype. fp32 / fp64: two stages;
    bf16: one product with the kernel's 2-D DFT matrix, as the C++ does (3.6x the multiply-adds, but one
    bf16 rounding instead of two and a shape bf16 GEMMs run well; docs/kernels.md)."""
    wt = w.detach().transpose(0, 1).to(dtype).contiguous()               # [C, O, K0, K1]
    C, O, K0, K1 = wt.shape
    if dtype == torch.bfloat16:
        m = _kernel_dft3(n, (K0, K1), _SIGMA_W, dtype)                   # [3 F, K0 K1]
        return torch.mm(m, wt.view(C * O, K0 * K1).t()).view(3, -1, C, O)
    return spectrum3(wt, n, (1, 1), (K0, K1), _SIGMA_W)


def inverse3_into(out, T, n, step, count, L):
    """out[p, q, i, j] (i < count0, j < count1) = the real inverse transform of V = L (T1, T2, T3) at the
    circle's position (step0 i, step1 j). T: [3, n0 K, P, Q]; out: [P, Q, >= count0, >= count1] contiguous
    (its other entries are left as they are). The first stage in T's dtype, the last in out's (a bf16 T
    into an fp32 out: the first stage's result, 2 count0 / (3 n0) of T's size, is widened to fp32)."""
    P, Q = T.shape[2], T.shape[3]
    K = _half(n[1])
    mi = _inverse_first_axis(n[0], step[0], count[0], L, T.dtype)         # [(i, part), (product, k0)]
    u = torch.mm(mi, T.reshape(3 * n[0], K * P * Q)).view(count[0], 2 * K, P * Q)
    if u.dtype != out.dtype:
        u = u.to(out.dtype)
    wl = _inverse_last_axis(n[0], n[1], step[1], count[1], out.dtype)    # [(part, k1), j]
    o = out.view(P * Q, out.shape[2], out.shape[3])
    for i in range(count[0]):                                            # straight into out's rows i
        torch.mm(u[i].t(), wl, out=o[:, i, :count[1]])
    return out


def _geometry(x_shape, w_shape, stride):
    out = tuple((x_shape[2 + d] - w_shape[2 + d]) // stride[d] + 1 for d in range(2))
    circle = tuple(stride[d] * (out[d] - 1) + w_shape[2 + d] for d in range(2))
    return out, circle


def _forward_products(xs, ws, b, out_size, circle, stride, out_dtype):
    """y [B, O, P, Q] from x's and w^T's spectra [3, F, B, C] / [3, F, C, O]."""
    F3, Fq, B, C = 3, xs.shape[1], xs.shape[2], xs.shape[3]
    O = ws.shape[3]
    T = torch.bmm(xs.view(F3 * Fq, B, C), ws.view(F3 * Fq, C, O)).view(3, Fq, B, O)
    y = torch.empty(B, O, out_size[0], out_size[1], dtype=out_dtype)
    inverse3_into(y, T, circle, stride, out_size, _L_FORWARD)
    if b is not None:
        y.add_(b.detach().view(1, -1, 1, 1).to(out_dtype))
    return y


def _spectra_dtype(x, w):
    if x.dtype == torch.bfloat16 and w.dtype == torch.float32:
        return torch.bfloat16, torch.float32      # bf16 spectra and products, fp32 y / dw / db
    assert x.dtype == w.dtype and x.dtype in (torch.float32, torch.float64), (x.dtype, w.dtype)
    return x.dtype, x.dtype


class SpectralConv2d(torch.autograd.Function):
    """y = F.conv2d(x, w, b, stride) through DFTs. x: [B, C, H, W] fp32 / fp64 (w and b the same), or bf16
    with w and b fp32 (y fp32, dx bf16, dw and db fp32). No padding, dilation 1, groups 1."""

    @staticmethod
    def forward(ctx, x, w, b, stride):
        spec_dtype, out_dtype = _spectra_dtype(x, w)
        out_size, circle = _geometry(x.shape, w.shape, stride)
        xs = spectrum3(x.contiguous(), circle, (1, 1), circle, _SIGMA_X)  # [3, F, B, C], kept for dw
        ws = weight_spectrum3(w, circle, spec_dtype)                      # [3, F, C, O], kept for dx
        y = _forward_products(xs, ws, b, out_size, circle, stride, out_dtype)
        ctx.stride, ctx.circle, ctx.spec_dtype = stride, circle, spec_dtype
        # The spectra live on ctx (not as saved tensors) so that the backward can drop x's before the input
        # gradient's product; x and w are saved to make them again for a second backward (retain_graph).
        ctx.save_for_backward(x, w)
        ctx.spectra = (xs, ws)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        stride, circle = ctx.stride, ctx.circle
        B, C, H, W = x.shape
        O, _, K0, K1 = w.shape
        x_dtype, w_dtype = x.dtype, w.dtype
        dx = dw = db = None
        with torch.autocast("cpu", enabled=False):
            if ctx.spectra is not None:
                xs, ws = ctx.spectra
                ctx.spectra = None                                       # each goes as soon as it is used
            else:                                                        # a second backward: made again
                xs = spectrum3(x.contiguous(), circle, (1, 1), circle, _SIGMA_X)
                ws = weight_spectrum3(w, circle, ctx.spec_dtype)
            del x, w
            Fq = xs.shape[1]
            if ctx.needs_input_grad[2]:
                db = dy.sum((0, 2, 3)).to(w_dtype)
            P, Q = dy.shape[2], dy.shape[3]
            dz = spectrum3(dy.to(xs.dtype).contiguous(), circle, stride, (P, Q), _SIGMA_DZ)  # [3, F, B, O]
            dz3 = dz.view(3 * Fq, B, O)
            # dx first: w's spectrum (fp32: 150 MB) goes before the weight gradient's products (150 MB).
            if ctx.needs_input_grad[0]:
                T = torch.bmm(dz3, ws.view(3 * Fq, C, O).transpose(1, 2)).view(3, Fq, B, C)
                del ws
                dx = torch.empty(B, C, H, W, dtype=x_dtype)
                if H > circle[0]:
                    dx[:, :, circle[0]:, :] = 0                          # rows and columns never read
                if W > circle[1]:
                    dx[:, :, :, circle[1]:] = 0
                inverse3_into(dx, T, circle, (1, 1), circle, _L_INPUT_GRAD)
                del T
            ws = None
            if ctx.needs_input_grad[1]:
                T = torch.bmm(dz3.transpose(1, 2), xs.view(3 * Fq, B, C)).view(3, Fq, O, C)
                del xs, dz, dz3
                dw = torch.empty(O, C, K0, K1, dtype=w_dtype)
                inverse3_into(dw, T, circle, (1, 1), (K0, K1), _L_WEIGHT_GRAD)
        return dx, dw, db, None


def conv2d_spectral(x, w, b, stride=(2, 2)):
    """Differentiable spectral convolution (SpectralConv2d)."""
    return SpectralConv2d.apply(x, w, b, tuple(stride))


class SpectralCapsNet(peer_tuned.TunedCapsNet):
    """peer_tuned.TunedCapsNet with PrimaryCaps through SpectralConv2d (same parameters, same order)."""

    def __init__(self, routing_iters=3, channels_last=False):
        super().__init__(routing_iters, channels_last)
        self._spectrum_cache = None     # (key, w^T's spectrum) for inference while w is unchanged

    def _primary_inference(self, h):
        """PrimaryCaps without autograd: spectral with a kept weight spectrum from batch 32 on."""
        w, b = self.primary.weight, self.primary.bias
        if h.shape[0] < SPECTRAL_INFER_MIN_BATCH:
            return self.primary(h)                                       # direct (autocast applies)
        with torch.autocast("cpu", enabled=False):
            x = h.to(torch.bfloat16) if h.dtype == torch.bfloat16 else h.float()
            spec_dtype, out_dtype = _spectra_dtype(x, w)
            out_size, circle = _geometry(x.shape, w.shape, (2, 2))
            key = (w.data_ptr(), w._version, spec_dtype, circle)
            if self._spectrum_cache is None or self._spectrum_cache[0] != key:
                self._spectrum_cache = None                              # free the old one first
                self._spectrum_cache = (key, weight_spectrum3(w, circle, spec_dtype))
            xs = spectrum3(x.contiguous(), circle, (1, 1), circle, _SIGMA_X)
            return _forward_products(xs, self._spectrum_cache[1], b, out_size, circle, (2, 2), out_dtype)

    def forward(self, x, y=None):
        B = x.shape[0]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        h = F.relu(self.conv1(x))
        w = self.primary.weight
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            self._spectrum_cache = None                                  # training: w changes every step
            bf16 = torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() == torch.bfloat16
            with torch.autocast("cpu", enabled=False):
                p = conv2d_spectral(h.to(torch.bfloat16) if bf16 else h.float(), w, self.primary.bias, (2, 2))
        else:
            p = self._primary_inference(h)                               # [B, 256, 6, 6]
        return self.capsules(p, y)                                    # as peer_tuned.TunedCapsNet


# ----------------------------------------------------------------------------------------------- --check

# bf16 against fp32 (x rounded to bf16, w and b fp32, against F.conv2d + autograd in fp32 on the unrounded
# inputs): max |difference| over the tensor's largest |entry|, PrimaryCaps' geometry at batch 16, seed 1.
# Measured (1 and 2 threads alike): y 7.41e-3, dx 5.82e-3, dw 6.83e-3, db 4.5e-7; tolerances ~1.5x those.
# For comparison oneDNN's direct bf16 convolution (x, w and b rounded): y 4.05e-3, dx 4.40e-3, dw 3.74e-3.
# Error budget of y (measured): rounding x alone 2.0e-3; x's and w's spectra rounded once to bf16 4.5e-3;
# as computed here (x's spectrum rounded after each of its two stages, w's after its one product)
# 6.3e-3; the products rounded to bf16 before the Gauss recombination 6.4e-3; the inverse's first stage
# rounded to bf16 7.4e-3.
BF16_TOL = {"y": 1.1e-2, "dx": 8.7e-3, "dw": 1.0e-2, "db": 1e-6}


def _rel(a, ref):
    return ((a.detach().double() - ref.detach().double()).abs().max() / ref.detach().double().abs().max().clamp_min(1e-300)).item()


def _check_float64(results):
    """Forward and all three gradients against F.conv2d + autograd in float64, several geometries."""
    geometries = [  # (B, C, O, H, W, K0, K1, stride)
        (4, 256, 256, 20, 20, 9, 9, (2, 2)),     # PrimaryCaps (batch 4)
        (3, 5, 7, 17, 23, 7, 5, (2, 3)),         # odd sizes, unequal strides, unread rows and columns
        (2, 4, 6, 12, 12, 3, 3, (1, 1)),         # stride 1
        (2, 3, 2, 20, 20, 9, 9, (3, 2)),
    ]
    gen = torch.Generator().manual_seed(7)
    for B, C, O, H, W, K0, K1, stride in geometries:
        x = torch.randn(B, C, H, W, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.randn(O, C, K0, K1, dtype=torch.float64, generator=gen, requires_grad=True)
        b = torch.randn(O, dtype=torch.float64, generator=gen, requires_grad=True)
        y_ref = F.conv2d(x, w, b, stride=stride)
        dy = torch.randn(y_ref.shape, dtype=torch.float64, generator=gen)
        g_ref = torch.autograd.grad(y_ref, (x, w, b), dy)
        y = conv2d_spectral(x, w, b, stride)
        g = torch.autograd.grad(y, (x, w, b), dy)
        tag = "f64 %dx%d->%d %dx%d k%dx%d s%s" % (B, C, O, H, W, K0, K1, "x".join(map(str, stride)))
        results.append((tag + " y", _rel(y, y_ref), 1e-10))
        for name, a, r in zip(("dx", "dw", "db"), g, g_ref):
            results.append((tag + " " + name, _rel(a, r), 1e-10))


def _check_gradcheck(results):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 4, 20, 20, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(6, 4, 9, 9, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # thousands of tiny calls: OpenMP only adds barrier waits
    try:
        # y is linear in each input, so central differences are exact up to rounding: a large step keeps
        # the numerical Jacobian's rounding (~1e-15 |y| / eps) far below the tolerances.
        ok = torch.autograd.gradcheck(lambda x, w, b: conv2d_spectral(x, w, b, (2, 2)), (x, w, b),
                                      eps=1e-2, atol=1e-9, rtol=1e-9)
        err = 0.0 if ok else 1.0
    except RuntimeError as e:          # gradcheck raises with the mismatching Jacobians
        print("gradcheck failed:", str(e).splitlines()[0], file=sys.stderr)
        err = 1.0
    finally:
        torch.set_num_threads(threads)
    results.append(("gradcheck f64 2x4->6 20x20 k9 s2 (0 = pass)", err, 0.0))


def cpu_has_native_bf16():
    """As capsnet's kernels::cpu_has_native_bf16 (AVX512-BF16 or AMX-BF16), where `capsnet bench` runs its
    bf16 configurations: elsewhere torch 1.13's bf16 GEMMs may fall back to slow reference loops."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return ("avx512f" in flags and "avx512_bf16" in flags) or "amx_bf16" in flags
    except OSError:
        pass
    return False


def _check_bf16(results, threads_note):
    """PrimaryCaps in bf16 (x bf16, fp32 master weights) against the fp32 reference on the same inputs."""
    if not cpu_has_native_bf16():
        print("bf16 check skipped: this CPU has no native bf16 (AVX512-BF16 / AMX-BF16), as `capsnet bench` "
              "runs no bf16 configuration there")
        return
    gen = torch.Generator().manual_seed(1)
    B = 16
    x = torch.relu(torch.randn(B, 256, 20, 20, generator=gen))            # like relu(Conv1's output)
    w = torch.randn(256, 256, 9, 9, generator=gen) * (1.0 / 9 / 16)      # Conv2d-init-like scale
    b = torch.randn(256, generator=gen) * 0.01
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y_ref = F.conv2d(xr, wr, br, stride=2)
    dy = torch.randn(y_ref.shape, generator=gen)
    g_ref = torch.autograd.grad(y_ref, (xr, wr, br), dy)
    xb = x.bfloat16().requires_grad_()
    wb, bb = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = conv2d_spectral(xb, wb, bb, (2, 2))
    g = torch.autograd.grad(y, (xb, wb, bb), dy)
    errs = {"y": _rel(y, y_ref), "dx": _rel(g[0], g_ref[0]), "dw": _rel(g[1], g_ref[1]), "db": _rel(g[2], g_ref[2])}
    # For context (not checked): oneDNN's direct bf16 convolution on the same inputs.
    xd, wd, bd = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_(), b.bfloat16().requires_grad_()
    yd = F.conv2d(xd, wd, bd, stride=2)
    gd = torch.autograd.grad(yd, (xd, wd, bd), dy.bfloat16())
    direct = {"y": _rel(yd, y_ref), "dx": _rel(gd[0], g_ref[0]), "dw": _rel(gd[1], g_ref[1])}
    print("bf16 PrimaryCaps (batch %d) max|err|/max|ref| against fp32: spectral %s; oneDNN direct bf16 %s%s"
          % (B, ", ".join("%s=%.3g" % kv for kv in errs.items()), ", ".join("%s=%.3g" % kv for kv in direct.items()),
             threads_note))
    for k, v in errs.items():
        results.append(("bf16 vs fp32 " + k, v, BF16_TOL[k]))


def _check_network(results, routing_iters, seed):
    """The whole network against peer_tuned.TunedCapsNet with the same weights: fp32 training (2 steps) and
    inference at batch 16 (direct) and 32 (spectral with the kept weight spectrum), within 1e-4."""
    torch.manual_seed(seed)
    tuned = peer_tuned.TunedCapsNet(routing_iters)
    with torch.no_grad():
        tuned.W.mul_(10)   # as peer_tuned's check: routing far from uniform
    spec = SpectralCapsNet(routing_iters)
    spec.load_state_dict(tuned.state_dict())
    images = torch.rand(32, 1, 28, 28)
    labels = torch.randint(0, 10, (32,))
    diffs = {}

    def md(a, b_):
        return (a.detach().float() - b_.detach().float()).abs().max().item()

    with torch.no_grad():
        for n in (16, 32):
            l0, r0 = tuned(images[:n])
            l1, r1 = spec(images[:n])
            diffs["infer_b%d_lengths" % n], diffs["infer_b%d_recon" % n] = md(l0, l1), md(r0, r1)
    im, lb = images[:16], labels[:16]
    opt0 = torch.optim.Adam(tuned.parameters(), lr=1e-3, foreach=True)
    opt1 = torch.optim.Adam(spec.parameters(), lr=1e-3, foreach=True)
    for step in range(2):
        opt0.zero_grad(set_to_none=True)
        opt1.zero_grad(set_to_none=True)
        l0, r0 = tuned(im, lb)
        loss0 = loss_fn(l0, r0, im, lb)
        l1, r1 = spec(im, lb)
        loss1 = loss_fn(l1, r1, im, lb)
        diffs["train_loss_step%d" % (step + 1)] = md(loss0, loss1)
        loss0.backward()
        loss1.backward()
        if step == 0:
            for name, p0 in tuned.named_parameters():
                if name in ("W", "primary.weight", "primary.bias", "conv1.weight"):
                    p1 = dict(spec.named_parameters())[name]
                    diffs["grad_%s_rel" % name] = md(p0.grad, p1.grad) / max(p0.grad.abs().max().item(), 1e-12)
        opt0.step()
        opt1.step()
    with torch.no_grad():   # after the updates: the kept spectrum must follow the new weights
        l0, _ = tuned(images)
        l1, _ = spec(images)
        diffs["infer_b32_after_update_lengths"] = md(l0, l1)
    for k, v in diffs.items():
        results.append(("network fp32 vs peer_tuned " + k, v, 1e-4))


def run_check(args):
    t0 = time.perf_counter()
    results = []   # (what, measured, tolerance)
    _check_float64(results)
    _check_gradcheck(results)
    _check_bf16(results, "" if torch.get_num_threads() == 1 else " (%d threads)" % torch.get_num_threads())
    _check_network(results, args.routing_iters, args.seed)
    failed = [r for r in results if not r[1] <= r[2]]
    for what, err, tol in results:
        print("  %-4s %-62s %.3g (tol %g)" % ("ok" if err <= tol else "FAIL", what, err, tol))
    print(("PASS" if not failed else "FAIL: %d of %d checks out of tolerance (%s)"
           % (len(failed), len(results), "; ".join(r[0] for r in failed)))
          + " -- %d checks, %.1f s" % (len(results), time.perf_counter() - t0))
    return 0 if not failed else 1


# ----------------------------------------------------------------------------------------------- timing

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    peer_tuned.add_args(ap, "channels_last Conv1 (as peer_tuned.py; PrimaryCaps is spectral either way)")
    ap.add_argument("--check", action="store_true",
                    help="float64 against F.conv2d + autograd, gradcheck, bf16 against fp32, the network "
                         "against peer_tuned.py; PASS/FAIL")
    args = ap.parse_args()
    peer_tuned.setup(args)
    if args.check:
        sys.exit(run_check(args))

    torch.manual_seed(args.seed)
    peer_tuned.measure(SpectralCapsNet(args.routing_iters, channels_last=args.channels_last), args, "peer-spectral",
                       "spectral plain PyTorch (Python, eager)", {"spectral_infer_min_batch": SPECTRAL_INFER_MIN_BATCH})


if __name__ == "__main__":
    main()
