#!/usr/bin/python3
"""Votes of the matrix-capsule layers, forward + backward: torch.matmul's broadcast vs einsum.

V[p, i, c] = M[p, i] W[i, c] (4x4 matrix products) for P = N * positions, I children, C parents:
poses M [P, I, 4, 4], weights W [I, C, 4, 4] -> [P, I, C, 16]. matmul broadcasts the weights to
every position and runs P*I*C separate 4x4 products; einsum runs I GEMMs [P*4, 4] x [4, C*4]
(what capsnet/nn/matrix_caps.cpp does since 2026-11-25). Shapes: the default EM model (A=32,
B=C=D=8) and the paper's small one (A=64, B=8, C=D=16), batch 32, 28x28 input.

Prints the median of 5 forward + backward passes of each, and their largest difference.
Run with Debian's python3 and one BLAS thread, as the capsnet executables use:
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 bench/em_votes.py --threads 1
"""
import argparse

import torch

from timing import median_seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = [("ConvCaps1, default", 32 * 25, 72, 8), ("ConvCaps2, default", 32 * 9, 72, 8),
             ("class caps, default", 32, 9 * 8, 10), ("ConvCaps1, small", 32 * 25, 72, 16),
             ("ConvCaps2, small", 32 * 9, 144, 16)]
    for name, P, I, C in cases:
        M = torch.randn(P, I, 4, 4, requires_grad=True)
        W = torch.randn(I, C, 4, 4, requires_grad=True)
        g = torch.randn(P, I, C, 16)
        by_matmul = lambda: torch.matmul(M.view(P, I, 1, 4, 4), W).reshape(P, I, C, 16)
        by_einsum = lambda: torch.einsum("pirk,ickd->picrd", M, W).reshape(P, I, C, 16)
        diff = (by_matmul() - by_einsum()).abs().max().item()
        t_mm = median_seconds(lambda: by_matmul().backward(g), reps=5, warmup=2)
        t_es = median_seconds(lambda: by_einsum().backward(g), reps=5, warmup=2)
        print(f"{name:22s} P={P:4d} I={I:3d} C={C:2d}  matmul {1e3 * t_mm:7.1f} ms  einsum {1e3 * t_es:7.1f} ms"
              f"  ({t_mm / t_es:.2f}x)  max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
