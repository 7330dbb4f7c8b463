#!/usr/bin/python3
"""The plain-PyTorch peer: the paper's MNIST CapsNet written the way published Python
implementations write it (eager mode; u_hat by one broadcast matmul over the whole batch;
routing by elementwise products and sums; masked decoder; margin + 0.0005 * SSE loss; Adam).

Same math as capsnet's default model (routing gradients flow through every iteration, softmax
over parents, squash with eps inside the sqrt), so the speed ratios compare like with like.

Prints one JSON line with the same fields as `capsnet bench`'s own workers:
  train_img_s, infer_img_s, latency_b1_ms, latency_b1_p90_ms, train_peak_rss_mb, train_rss_growth_mb, ...
Run by `capsnet bench`; runnable alone:  /usr/bin/python3 bench/peer_capsnet.py --steps 5
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def squash(s, dim=-1, eps=1e-8):
    sq = (s * s).sum(dim, keepdim=True)
    return sq / (1 + sq) * s / torch.sqrt(sq + eps)


class PeerCapsNet(nn.Module):
    def __init__(self, routing_iters=3):
        super().__init__()
        self.iters = routing_iters
        self.conv1 = nn.Conv2d(1, 256, 9)
        self.primary = nn.Conv2d(256, 32 * 8, 9, stride=2)
        self.W = nn.Parameter(0.01 * torch.randn(1, 1152, 10, 16, 8))  # [1, I, J, D, Din]
        self.decoder = nn.Sequential(nn.Linear(160, 512), nn.ReLU(), nn.Linear(512, 1024), nn.ReLU(),
                                     nn.Linear(1024, 784), nn.Sigmoid())

    def forward(self, x, y=None):
        B = x.shape[0]
        h = F.relu(self.conv1(x))
        p = self.primary(h)                                              # [B, 256, 6, 6]
        u = squash(p.view(B, 32, 8, 6, 6).permute(0, 1, 3, 4, 2).reshape(B, 1152, 8))
        u_hat = torch.matmul(self.W, u[:, :, None, :, None]).squeeze(-1)  # [B, 1152, 10, 16]
        b = torch.zeros(B, 1152, 10, device=x.device)
        for r in range(self.iters):
            c = F.softmax(b, dim=2)                                      # over parents
            v = squash((c.unsqueeze(-1) * u_hat).sum(dim=1))             # [B, 10, 16]
            if r < self.iters - 1:
                b = b + (u_hat * v.unsqueeze(1)).sum(dim=-1)
        lengths = v.norm(dim=-1)                                         # [B, 10]
        if y is None:
            y = lengths.argmax(dim=1)
        mask = F.one_hot(y, 10).to(v.dtype)
        recon = self.decoder((v * mask.unsqueeze(-1)).reshape(B, -1))
        return lengths, recon


def loss_fn(lengths, recon, images, labels):
    t = F.one_hot(labels, 10).to(lengths.dtype)
    margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
    sse = ((recon - images.view(images.shape[0], -1)) ** 2).sum(1).mean()
    return margin + 0.0005 * sse


def reset_peak_rss():
    # Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so each phase gets its own peak.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (after 2 warm-up steps)")
    ap.add_argument("--infer-batches", type=int, default=5)
    ap.add_argument("--latency-runs", type=int, default=30)
    ap.add_argument("--routing-iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    B = args.batch_size
    model = PeerCapsNet(args.routing_iters)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    images = torch.rand(B, 1, 28, 28)
    labels = torch.randint(0, 10, (B,))

    def train_step():
        opt.zero_grad()
        lengths, recon = model(images, labels)
        loss = loss_fn(lengths, recon, images, labels)
        loss.backward()
        opt.step()
        return loss.item()

    rss_before = rss_mb("VmRSS")
    reset_peak_rss()
    for _ in range(2):
        train_step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t)
    train_peak = rss_mb("VmHWM")

    model.eval()
    infer = []
    with torch.no_grad():
        model(images)
        for _ in range(args.infer_batches):
            t = time.perf_counter()
            model(images)[0].argmax(1)
            infer.append(time.perf_counter() - t)
        one = images[:1].clone()
        for _ in range(3):
            model(one)
        lat = []
        for _ in range(args.latency_runs):
            t = time.perf_counter()
            model(one)[0].argmax(1)
            lat.append(time.perf_counter() - t)

    print(json.dumps({
        "config": "peer", "impl": "plain PyTorch (Python, eager) " + torch.__version__,
        "batch_size": B, "threads": torch.get_num_threads(), "routing_iters": args.routing_iters,
        "train_img_s": B / statistics.median(times), "infer_img_s": B / statistics.median(infer),
        "latency_b1_ms": 1000 * statistics.median(lat),
        "latency_b1_p90_ms": 1000 * sorted(lat)[math.ceil(0.9 * len(lat)) - 1],
        "train_peak_rss_mb": train_peak, "train_rss_growth_mb": train_peak - rss_before,
        "steps": args.steps,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
