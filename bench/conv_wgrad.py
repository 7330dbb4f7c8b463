#!/usr/bin/python3
"""Weight gradient of the PrimaryCaps convolution: oneDNN's backward vs one GEMM on unfolded input.

The convolution (paper sizes): input [B, 256, 20, 20], weight [256, 256, 9, 9], stride 2 -> [B, 256, 6, 6].
dW[o, c*81] = sum over b and the 36 output positions of dY[b, o, p] * X_unfold[b, c*81, p]: a
256 x 20736 x (36 B) GEMM, 2 * 256 * 20736 * 36 * B FLOPs (3.8 GFLOP per 10 images).

Prints the median time of each path (fp32 and bf16) at the given batch, and checks they agree.
Run with Debian's python3:  /usr/bin/python3 bench/conv_wgrad.py --threads 2 --batch 100
"""
import argparse

import torch
import torch.nn.functional as F

from timing import median_seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=25, help="images per unfold+GEMM chunk (bounds the unfold buffer)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B = args.batch
    flops = 2 * 256 * 20736 * 36 * B
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(B, 256, 20, 20).to(dtype)
        w = (0.01 * torch.randn(256, 256, 9, 9)).to(dtype)
        gy = torch.randn(B, 256, 6, 6).to(dtype)

        def onednn():
            return torch.ops.aten.convolution_backward(gy, x, w, [256], [2, 2], [0, 0], [1, 1], False, [0, 0], 1,
                                                       [False, True, False])[1]

        def onednn_input_grad():
            return torch.ops.aten.convolution_backward(gy, x, w, [256], [2, 2], [0, 0], [1, 1], False, [0, 0], 1,
                                                       [True, False, False])[0]

        def gemm():
            dw = torch.zeros(256, 20736, dtype=torch.float32)
            for s in range(0, B, args.chunk):
                xs = x[s:s + args.chunk]
                cols = F.unfold(xs, 9, stride=2)  # [b, 20736, 36]
                gys = gy[s:s + args.chunk].reshape(xs.shape[0], 256, 36)
                # [256, b*36] @ [b*36, 20736]
                a = gys.permute(1, 0, 2).reshape(256, -1)
                bm = cols.permute(0, 2, 1).reshape(-1, 20736)
                dw += torch.mm(a, bm).float()
            return dw.view(256, 256, 9, 9)

        # The GEMM alone, on input unfolded beforehand (what an older note in docs/kernels.md timed).
        a_all = gy.reshape(B, 256, 36).permute(1, 0, 2).reshape(256, -1).contiguous()
        b_all = F.unfold(x, 9, stride=2).permute(0, 2, 1).reshape(-1, 20736).contiguous()

        def gemm_only():
            return torch.mm(a_all, b_all)

        ref = onednn().float()
        mine = gemm()
        err = (ref - mine).abs().max().item() / ref.abs().max().item()
        t_dnn = median_seconds(onednn, args.reps)
        t_gemm = median_seconds(gemm, args.reps)
        t_in = median_seconds(onednn_input_grad, args.reps)
        t_mm = median_seconds(gemm_only, args.reps)
        name = "fp32" if dtype == torch.float32 else "bf16"
        print(f"{name}: weight grad oneDNN {1e3 * t_dnn:.1f} ms ({flops / t_dnn / 1e9:.0f} GFLOP/s), "
              f"unfold+GEMM (chunks of {args.chunk}) {1e3 * t_gemm:.1f} ms ({flops / t_gemm / 1e9:.0f} GFLOP/s), "
              f"ratio {t_dnn / t_gemm:.2f}; the GEMM alone on pre-unfolded input {1e3 * t_mm:.1f} ms "
              f"({flops / t_mm / 1e9:.0f} GFLOP/s); input grad oneDNN {1e3 * t_in:.1f} ms; max rel diff {err:.2e}")


if __name__ == "__main__":
    main()
