#!/usr/bin/env python3
"""GPU benchmark of the fused capsule ops (docs/gpu.md): run by scripts/device_check.sh on a CUDA machine.

1. routing: capsnet::capsule_routing forward + backward against the plain-PyTorch Procedure 1
   (python/capsnet/ops.py reference_routing: u_hat by one einsum, routing by elementwise ops), eager and
   torch.compile'd, MNIST sizes (I = 1152 -> 10 x 16), float32 and bfloat16, batch 128 and 512.
2. step: one whole CapsNet training step (forward, margin + 0.0005 reconstruction loss, backward, Adam) under
   bfloat16 autocast: python/capsnet's CapsNet (fused op) against the plain-PyTorch peer (bench/peer_capsnet.py),
   eager and compiled.
3. epoch: one MNIST epoch of python/capsnet's CapsNet on the GPU (batch 128, Adam 1e-3, bf16 autocast) and
   its test accuracy, when --mnist names a folder with the four IDX files (optionally .gz).

Times are medians of CUDA-event-timed repeats after warm-up; memory is the peak allocated by the timed
call above what was allocated before it. One JSON object per line to --out (and stdout) as each result lands.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

from capsnet import model as capsmodel  # noqa: E402
from capsnet.idx import read_idx  # noqa: E402
from capsnet import ops as capsops  # noqa: E402
import peer_capsnet  # noqa: E402

OUT = None


def emit(record):
    record["device"] = torch.cuda.get_device_name()
    record["torch"] = torch.__version__
    line = json.dumps(record)
    print(line, flush=True)
    if OUT:
        with open(OUT, "a") as f:
            f.write(line + "\n")


def time_cuda(fn, warmup=3, repeats=20):
    """Median milliseconds of fn() by CUDA events, and the peak bytes allocated above the start."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base, times


def bench_routing(batches, compile_ok):
    I, J, D, Din, r = 1152, 10, 16, 8, 3
    eager = capsops.reference_routing
    compiled = torch.compile(capsops.reference_routing) if compile_ok else None
    for dtype in (torch.float32, torch.bfloat16):
        for B in batches:
            g = torch.Generator(device="cuda").manual_seed(B)
            u = (torch.randn(B, I, Din, device="cuda", generator=g) * 0.5).to(dtype).requires_grad_()
            W = (torch.randn(I, J, D, Din, device="cuda", generator=g) * 0.35).to(dtype).requires_grad_()
            gv = torch.randn(B, J, D, device="cuda", generator=g).to(dtype)
            impls = [("fused", lambda a, b: torch.ops.capsnet.capsule_routing(a, b, r, True)),
                     ("eager", lambda a, b: eager(a, b, r, True))]
            if compiled is not None:
                impls.append(("compiled", lambda a, b: compiled(a, b, r, True)))
            ref_v = None
            for name, f in impls:
                def step():
                    v = f(u, W)
                    torch.autograd.grad(v, (u, W), gv)
                try:
                    t0 = time.perf_counter()
                    v = f(u, W)
                    first_s = time.perf_counter() - t0
                    err = None
                    if ref_v is None:
                        ref_v = v.detach().float()
                    else:
                        err = ((v.detach().float() - ref_v).norm() / ref_v.norm()).item()
                    ms, peak, _ = time_cuda(step)
                    fwd_ms, fwd_peak, _ = time_cuda(lambda: f(u, W))
                    emit({"bench": "routing", "impl": name, "dtype": str(dtype).split(".")[1], "batch": B,
                          "fwd_bwd_ms": ms, "img_s": B / ms * 1e3, "fwd_ms": fwd_ms, "peak_mb": peak / 2**20,
                          "fwd_peak_mb": fwd_peak / 2**20, "rel_diff_vs_fused": err,
                          "first_call_s": first_s})
                except Exception as e:  # keep going: a failed compile must not hide the other numbers
                    emit({"bench": "routing", "impl": name, "dtype": str(dtype).split(".")[1], "batch": B,
                          "error": repr(e)[:500]})


def margin_loss(lengths, recon, images, labels):
    lengths, recon = lengths.float(), recon.float()
    t = F.one_hot(labels, 10).float()
    margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
    return margin + 0.0005 * ((recon - images.flatten(1)) ** 2).sum(1).mean()


def ours():
    return capsmodel.CapsNet(fused=True).cuda()


def ours_forward(m, x, y):
    out = m(x, y)
    return out.lengths, out.reconstruction


def peer_forward(m, x, y):
    return m(x, y)


def bench_step(B, compile_ok):
    torch.manual_seed(1)
    x = torch.rand(B, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (B,), device="cuda")
    variants = [("capsnet fused", ours, ours_forward),
                ("peer eager", lambda: peer_capsnet.PeerCapsNet(3).cuda(), peer_forward)]
    if compile_ok:
        variants.append(("peer compiled", lambda: torch.compile(peer_capsnet.PeerCapsNet(3).cuda()), peer_forward))
    for name, make, fwd in variants:
        try:
            m = make()
            opt = torch.optim.Adam(m.parameters(), lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    lengths, recon = fwd(m, x, y)
                loss = margin_loss(lengths, recon, x, y)
                loss.backward()
                opt.step()

            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            ms, peak, _ = time_cuda(step, warmup=5, repeats=30)
            emit({"bench": "step", "impl": name, "batch": B, "precision": "bf16 autocast", "step_ms": ms,
                  "img_s": B / ms * 1e3, "peak_mb": (peak + torch.cuda.memory_allocated()) / 2**20,
                  "first_step_s": first_s})
            del m, opt
            torch.cuda.empty_cache()
        except Exception as e:
            emit({"bench": "step", "impl": name, "batch": B, "error": repr(e)[:500]})


def bench_epoch(folder, B, seed):
    torch.manual_seed(seed)
    xs = read_idx(folder, "train-images-idx3-ubyte").cuda().float().div_(255).unsqueeze(1)
    ys = read_idx(folder, "train-labels-idx1-ubyte").cuda().long()
    xt = read_idx(folder, "t10k-images-idx3-ubyte").cuda().float().div_(255).unsqueeze(1)
    yt = read_idx(folder, "t10k-labels-idx1-ubyte").cuda().long()
    m = ours()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    order = torch.randperm(xs.shape[0], device="cuda")
    m.train()
    for k in range(0, xs.shape[0], B):
        idx = order[k:k + B]
        x, y = xs[idx], ys[idx]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lengths, recon = ours_forward(m, x, y)
        margin_loss(lengths, recon, x, y).backward()
        opt.step()
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    m.eval()
    correct = 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for k in range(0, xt.shape[0], 1000):
            correct += (m(xt[k:k + 1000]).lengths.argmax(1) == yt[k:k + 1000]).sum().item()
    emit({"bench": "epoch", "impl": "capsnet fused", "batch": B, "precision": "bf16 autocast", "seed": seed,
          "epoch_s": train_s, "img_s": xs.shape[0] / train_s, "test_accuracy": correct / xt.shape[0]})


def main():
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops-library", required=True)
    ap.add_argument("--out", default=None, help="JSON lines file (appended)")
    ap.add_argument("--mnist", default=None, help="folder with the MNIST IDX files (optionally .gz)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--only", default="routing,step,epoch")
    args = ap.parse_args()
    OUT = args.out
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device")
        return 2
    torch.backends.cudnn.benchmark = True
    capsops.load_library(args.ops_library)
    parts = args.only.split(",")
    if "routing" in parts:
        bench_routing((128, 512), not args.no_compile)
    if "epoch" in parts and args.mnist:
        bench_epoch(args.mnist, 128, seed=1)
    if "step" in parts:
        bench_step(128, not args.no_compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
