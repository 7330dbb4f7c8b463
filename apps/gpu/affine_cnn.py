#!/usr/bin/env python3
"""The affine experiment's baseline CNN (capsnet::models::BaselineCnn) trained on a GPU with `capsnet affine`'s
protocol, and scored on the test sets that `capsnet affine --write-sets` writes.

The CNN the paper compares CapsNet with on affNIST is unpooled (three 5x5 "same" convolutions of 256 / 256 /
128 channels, FC 328 and 192 with dropout 0.5: 69.7M parameters at 40x40), too slow for this project's CPUs
(docs/robustness.md). Protocol as `capsnet affine --model cnn --cnn-no-pool` runs it: training digits placed
at a random offset of up to 6 px from the centre of a 40x40 canvas (a new offset per image and epoch), the
last --val training digits placed once as a validation split, Adam (1e-4 for the unpooled net) with the rate
x --lr-decay per epoch, cross-entropy; training stops at the first epoch whose validation accuracy reaches
--target-accuracy (0.992: the paper's translated-MNIST level), and the best-validation model is scored on
every set of --sets (sets.json; "translated" and "affnist-style" among them). Writes results.json (each set's
accuracy), metrics.jsonl and the log; --save writes the scored model as a `capsnet export` weight file
(model "baseline-cnn", fp16) that `capsnet eval --checkpoint M --images X --labels Y` reads.

    python3 apps/gpu/affine_cnn.py --data data/mnist --sets data/device/affine-sets --out runs/gpu-affine-nopool-s1 \\
        --seed 1 --lr 1e-4
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import Metrics, autocast, fail, load_split, read_idx, refuse_previous_run, save_weights  # noqa: E402

CANVAS, MAX_SHIFT = 40, 6


class BaselineCnn(nn.Module):
    """capsnet::models::BaselineCnn: conv 5x5 "same" x3 (ReLU; 2x2 max-pool after conv1 and conv2 when pooled),
    fc1, fc2 (ReLU, dropout), out. Parameter names as the C++ module's."""

    def __init__(self, config):
        super().__init__()
        c = self.config = config
        k, p = c["kernel_size"], c["kernel_size"] // 2
        self.conv1 = nn.Conv2d(c["image_channels"], c["conv1_channels"], k, padding=p)
        self.conv2 = nn.Conv2d(c["conv1_channels"], c["conv2_channels"], k, padding=p)
        self.conv3 = nn.Conv2d(c["conv2_channels"], c["conv3_channels"], k, padding=p)
        side = c["image_size"] // 4 if c["pooling"] else c["image_size"]
        self.fc1 = nn.Linear(c["conv3_channels"] * side * side, c["fc1_units"])
        self.fc2 = nn.Linear(c["fc1_units"], c["fc2_units"])
        self.out = nn.Linear(c["fc2_units"], c["num_classes"])
        self.drop = nn.Dropout(c["dropout"])

    def forward(self, x):  # x: [B, 1, S, S] in [0, 1] -> logits [B, K]
        x = torch.relu(self.conv1(x))
        if self.config["pooling"]:
            x = F.max_pool2d(x, 2)
        x = torch.relu(self.conv2(x))
        if self.config["pooling"]:
            x = F.max_pool2d(x, 2)
        x = torch.relu(self.conv3(x)).flatten(1)
        x = self.drop(torch.relu(self.fc1(x)))
        x = self.drop(torch.relu(self.fc2(x)))
        return self.out(x)


def cnn_config(pooling, small):
    c = {"image_channels": 1, "image_size": CANVAS, "conv1_channels": 256, "conv2_channels": 256,
         "conv3_channels": 128, "kernel_size": 5, "pooling": pooling, "fc1_units": 328, "fc2_units": 192,
         "num_classes": 10, "dropout": 0.5, "stn": False, "stn_size": 0}
    if small:  # tests only
        c.update({"conv1_channels": 8, "conv2_channels": 8, "conv3_channels": 4, "fc1_units": 16, "fc2_units": 12})
    return c


def place(images, dx, dy, canvas=CANVAS):
    """uint8/float digits [B, H, W] -> [B, 1, canvas, canvas] float in [0, 1], each at offset (dx, dy) from the
    centre (|d| <= (canvas - H) / 2), zero background."""
    B, H, W = images.shape
    border = (canvas - H) // 2
    out = torch.zeros(B, canvas, canvas, device=images.device)
    rows = (torch.arange(H, device=images.device) + border + dy.view(B, 1)).view(B, H, 1)
    cols = (torch.arange(W, device=images.device) + border + dx.view(B, 1)).view(B, 1, W)
    out[torch.arange(B, device=images.device).view(B, 1, 1), rows, cols] = images.float() / 255
    return out.unsqueeze(1)


@torch.no_grad()
def accuracy(model, images, labels, device, precision, batch=500):
    """images [N, 1, S, S] float or [N, S, S] uint8."""
    model.eval()
    correct = 0
    for k in range(0, images.shape[0], batch):
        x = images[k:k + batch].to(device)
        x = x.float().div(255).unsqueeze(1) if x.dtype == torch.uint8 else x
        with autocast(device, precision):
            correct += (model(x).argmax(1) == labels[k:k + batch].to(device)).sum().item()
    model.train()
    return correct / images.shape[0]


def main(argv=None):
    argv = argv if argv is not None else sys.argv[1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="MNIST IDX folder (plain or .gz)")
    ap.add_argument("--sets", required=True, help="folder written by `capsnet affine --write-sets` (files may be .gz)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pool", action="store_true", help="the pooled CNN (default: unpooled, the paper's)")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--target-accuracy", type=float, default=0.992)
    ap.add_argument("--val", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr-decay", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None)
    ap.add_argument("--save", default=None, help="write the scored model here (capsnet-weights, fp16)")
    ap.add_argument("--train-limit", type=int, default=0, help="first N training digits only (tests)")
    ap.add_argument("--small", action="store_true", help="narrow layers (tests)")
    ap.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    args = ap.parse_args(argv)
    refuse_previous_run(args.out, args.overwrite)
    if args.epochs < 1 or args.val < 1 or not 0 <= args.target_accuracy <= 1 or not 0 < args.lr_decay <= 1:
        ap.error("--epochs >= 1, --val >= 1, --target-accuracy in [0, 1], --lr-decay in (0, 1]")
    precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    sets_json = os.path.join(args.sets, "sets.json")
    if not os.path.isfile(sets_json):
        fail(f"{args.sets}: no sets.json (write the sets with `capsnet affine --write-sets DIR`)")
    files = json.load(open(sets_json))["files"]

    train_x, train_y = load_split(args.data, "train")
    if args.train_limit:
        train_x, train_y = train_x[:args.train_limit], train_y[:args.train_limit]
    if args.val >= train_x.shape[0]:
        fail(f"--val {args.val} leaves no training digits (of {train_x.shape[0]})")
    n = train_x.shape[0] - args.val
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    vgen = torch.Generator().manual_seed(args.seed + 1_000_003)
    val_shift = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2, args.val), generator=vgen)
    val_x, val_y = place(train_x[n:], val_shift[0], val_shift[1]), train_y[n:]
    gx, gy = train_x[:n].to(device), train_y[:n].to(device)

    model = BaselineCnn(cnn_config(args.pool, args.small)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    os.makedirs(args.out, exist_ok=True)
    metrics = Metrics(os.path.join(args.out, "metrics.jsonl"), append=False)
    name = "cnn" if args.pool else "cnn-nopool"
    params = sum(p.numel() for p in model.parameters())
    metrics.write({"event": "start", "options": dict(vars(args), precision=precision, model=name, parameters=params,
                                                     torch=torch.__version__)})
    print(f"{name}: {params} parameters, {n} training digits per epoch at batch {args.batch_size}, "
          f"{args.val} validation digits, {device} {precision}", flush=True)
    best, best_state, step, t_train = None, None, 0, 0.0
    steps_per_epoch = -(-n // args.batch_size)
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = torch.randperm(n, device=device, generator=gen)
        shift = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2, n), device=device, generator=gen)
        loss_sum = torch.zeros((), device=device)
        for k in range(0, n, args.batch_size):
            idx = order[k:k + args.batch_size]
            x, y = place(gx[idx], shift[0, idx], shift[1, idx]), gy[idx]
            for group in opt.param_groups:  # x decay per epoch, smoothly per step (the C++ loop's rule)
                group["lr"] = args.lr * args.lr_decay ** (step / steps_per_epoch)
            opt.zero_grad(set_to_none=True)
            with autocast(device, precision):
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            step += 1
            loss_sum += loss.detach() * x.shape[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        val = accuracy(model, val_x, val_y, device, precision)
        metrics.write({"event": "eval", "split": "val", "epoch": float(epoch), "step": step, "accuracy": val,
                       "loss": loss_sum.item() / n, "train_seconds": t_train})
        line = (f"epoch {epoch}: train loss {loss_sum.item() / n:.4f} ({n / (time.perf_counter() - t0):.0f} img/s) | "
                f"validation {100 * val:.2f}%")
        if best is None or val > best[0]:
            best = (val, epoch, step)
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            line += " (best)"
        print(line, flush=True)
        if args.target_accuracy > 0 and val >= args.target_accuracy:
            break
    model.load_state_dict(best_state)
    results = {"model": name, "parameters": params, "seed": args.seed, "epochs_trained": epoch,
               "best_epoch": best[1], "validation_accuracy": best[0], "train_seconds": t_train,
               "reached_target": best[0] >= args.target_accuracy, "target_accuracy": args.target_accuracy,
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "precision": precision, "command": "python3 apps/gpu/affine_cnn.py " + " ".join(argv), "sets": {}}
    for set_name, f in sorted(files.items()):
        x = read_idx(args.sets, f["images"])
        y = read_idx(args.sets, f["labels"]).long()
        results["sets"][set_name] = accuracy(model, x, y, device, precision)
        print(f"  {set_name}: {100 * results['sets'][set_name]:.2f}%", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    if args.save:
        save_weights(args.save, model, best[2], {k: v for k, v in results.items() if k != "sets"}, kind="baseline-cnn")
    print(f"scored epoch {best[1]} (validation {100 * best[0]:.2f}%); wrote {os.path.join(args.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
