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
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from timing import add_peer_args, capsnet_steps, measure_peer


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_peer_args(ap)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    B = args.batch_size
    model = PeerCapsNet(args.routing_iters)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    images = torch.rand(B, 1, 28, 28)
    labels = torch.randint(0, 10, (B,))

    train_step, predict = capsnet_steps(model, opt, loss_fn, images, labels)
    result = {"config": "peer", "impl": "plain PyTorch (Python, eager) " + torch.__version__,
              "threads": torch.get_num_threads()}
    result.update(measure_peer(train_step, model, predict, images, args, torch.no_grad))
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
