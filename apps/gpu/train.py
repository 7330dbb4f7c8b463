#!/usr/bin/env python3
"""Trains the paper's CapsNet (python/capsnet, fused routing) on MNIST or Fashion-MNIST, on a GPU.

The protocol of `capsnet train --val N` (docs/results.md): the last N training images are held out as a
validation split; each epoch ends with the validation split and then the test set scored; best.pt holds the
epoch with the best validation accuracy (ties: the lower validation loss), and its test accuracy is only
reported. Training as in the C++ tool: a random shift of up to 2 pixels per image and epoch (zero fill),
margin loss summed over the classes + 0.0005 x the reconstruction's squared error (decoder masked by the
label), Adam, `--schedule paper` (1e-3 x 0.96 every 2,000 steps, smooth) or `fast` (one-cycle: lr / 25 up to
lr over the first quarter, cosine down to lr / 1e4), optionally the weights' moving average (`--ema-decay`,
TensorFlow's warm-up) as the evaluated and kept model.

Outputs in --out: metrics.jsonl (the C++ tool's records: "start", "train", "eval" per split and epoch,
"best", "end"; docs/runs/epochs.py reads it), best.pt and last.pt as `capsnet export` weight files (fp16
storage, model card inside) that `capsnet eval --checkpoint` scores and scripts/ship_model.sh ships, and the
log on stdout. `--minutes M` plans the run to fit: a short timing probe on random data before training sets
the number of epochs to what fits in M minutes (at most --epochs; the schedule spans that number), so the
run ends with its schedule, not cut off.

    python3 apps/gpu/train.py --data data/mnist --out runs/gpu-mnist-s1 --epochs 100 --minutes 8 \\
        --schedule fast --lr 3e-3 --val 5000 --seed 1 --ops-library build-cuda17link/capsnet/ops/libcapsnet_ops.so

On a CPU (no --device cuda) it runs in fp32 and slowly: the tests use it on a few hundred images.
A file written by a newer PyTorch can be rewritten for Debian's (which `capsnet` links) with
`/usr/bin/python3 apps/gpu/train.py --resave IN OUT`.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
from capsnet import model as capsmodel  # noqa: E402
from capsnet import idx  # noqa: E402
from capsnet import ops as capsops  # noqa: E402

MAX_SHIFT = 2


def fail(message):
    print(f"{os.path.basename(sys.argv[0]) or 'train.py'}: {message}", file=sys.stderr)
    sys.exit(2)


def read_idx(folder, name):
    """capsnet.idx.read_idx, its errors as one line and exit status 2."""
    try:
        return idx.read_idx(folder, name)
    except (OSError, ValueError) as e:
        fail(str(e))


def load_split(folder, prefix):
    images = read_idx(folder, f"{prefix}-images-idx3-ubyte")
    labels = read_idx(folder, f"{prefix}-labels-idx1-ubyte")
    if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
        fail(f"{folder}: {prefix} images {list(images.shape)} and labels {list(labels.shape)} do not match")
    return images, labels.long()


def shifted(images, dx, dy, max_shift=MAX_SHIFT):
    """images [B, 1, H, W] moved by (dx, dy) pixels each (right, down; |d| <= max_shift), zero fill."""
    B, _, H, W = images.shape
    p = F.pad(images[:, 0], (max_shift, max_shift, max_shift, max_shift))  # [B, H + 2m, W + 2m]
    rows = torch.arange(H, device=images.device) + max_shift - dy.view(B, 1)  # output row r reads r - dy
    cols = torch.arange(W, device=images.device) + max_shift - dx.view(B, 1)
    b = torch.arange(B, device=images.device).view(B, 1, 1)
    return p[b, rows.view(B, H, 1), cols.view(B, 1, W)].unsqueeze(1)


def learning_rate(schedule, lr, step, total_steps, warmup=0.25):
    """The C++ LoopOptions::learning_rate: paper = lr x 0.96^(step / 2000); fast = one-cycle."""
    if schedule == "paper":
        return lr * 0.96 ** (step / 2000)
    t = step / (total_steps - 1) if total_steps > 1 else 1.0
    start, end = lr / 25, lr / 1e4
    if t < warmup:
        return start + (lr - start) * t / warmup
    u = (t - warmup) / (1 - warmup)
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * u))


def losses(out, images, labels, recon_weight):
    """(total, margin, sse): margin summed over classes and SSE over pixels, both averaged over the batch."""
    lengths = out.lengths.float()
    t = F.one_hot(labels, lengths.shape[1]).float()
    margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
    sse = ((out.reconstruction.float() - images.flatten(1)) ** 2).sum(1).mean()
    return margin + recon_weight * sse, margin, sse


class WeightAverage:
    """a <- d a + (1 - d) p, d = min(decay, (1 + t) / (10 + t)) after update t (capsnet/train/weight_average.h)."""

    def __init__(self, params, decay):
        self.params, self.decay = list(params), decay
        self.avg = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, t):
        d = min(self.decay, (1 + t) / (10 + t))
        torch._foreach_mul_(self.avg, d)
        torch._foreach_add_(self.avg, [p.detach() for p in self.params], alpha=1 - d)

    @torch.no_grad()
    def swap(self):
        for p, a in zip(self.params, self.avg):
            tmp = p.detach().clone()
            p.copy_(a)
            a.copy_(tmp)


class Metrics:
    def __init__(self, path, append):
        self.f = open(path, "a" if append else "w")

    def write(self, record):
        record["time"] = time.time()
        self.f.write(json.dumps(record, sort_keys=True) + "\n")
        self.f.flush()


def autocast(device, precision):
    if device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate(model, images, labels, device, precision, recon_weight, batch=1000):
    """(accuracy, mean loss): the longest capsule is the prediction; the loss masks the decoder by the label."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for k in range(0, images.shape[0], batch):
        x = images[k:k + batch].to(device).float().div_(255).unsqueeze(1)
        y = labels[k:k + batch].to(device)
        with autocast(device, precision):
            out = model(x, y)
        loss, _, _ = losses(out, x, y, recon_weight)
        correct += (out.lengths.argmax(1) == y).sum().item()
        loss_sum += loss.item() * x.shape[0]
    model.train()
    return correct / images.shape[0], loss_sum / images.shape[0]


def atomic_save(obj, path):
    """torch.save into path + ".tmp", then renamed over path."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def weights_dict(model, step, card, kind="capsnet"):
    """The dict of a `capsnet export` weight file (fp16 storage) of a module with a `config` dict; kind is its
    "model" entry ("capsnet", "baseline-cnn")."""
    return {"format": capsmodel.FORMAT, "version": capsmodel.VERSION, "model": kind,
            "config": json.dumps(model.config, sort_keys=True), "step": int(step), "storage": "fp16",
            "state_dict": {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()},
            "card": json.dumps(card, sort_keys=True)}


def save_weights(path, model, step, card, kind="capsnet"):
    """weights_dict written atomically to path."""
    atomic_save(weights_dict(model, step, card, kind), path)


def seconds_per_call(fn, device, warmup, calls):
    """Mean seconds of fn(k) over k = warmup .. warmup + calls - 1, after fn(0 .. warmup - 1); the GPU synchronised."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for k in range(warmup):
        fn(k)
    sync()
    t0 = time.perf_counter()
    for k in range(warmup, warmup + calls):
        fn(k)
    sync()
    return (time.perf_counter() - t0) / calls


def new_model(device, fused, init="torch"):
    return capsmodel.CapsNet(dict(capsmodel.DEFAULT_CONFIG, init=init), fused=fused).to(device)


def make_optimizer(model, lr, device):
    if device.type == "cuda":
        try:
            return torch.optim.Adam(model.parameters(), lr=lr, fused=True)
        except (TypeError, RuntimeError):
            pass
    return torch.optim.Adam(model.parameters(), lr=lr)


def time_probe(args, device, steps_per_epoch, eval_images):
    """Seconds per training step and per evaluated image, measured on random data with a throwaway model."""
    m = new_model(device, not args.reference_routing)
    opt = make_optimizer(m, 1e-4, device)
    x = torch.rand(args.batch_size, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)

    def step(_):
        opt.zero_grad(set_to_none=True)
        with autocast(device, args.precision):
            out = m(x, y)
        losses(out, x, y, args.recon_weight)[0].backward()
        opt.step()

    step_s = seconds_per_call(step, device, 5, 20)
    xe = torch.randint(0, 256, (min(eval_images, 2000), 28, 28), dtype=torch.uint8)
    ye = torch.randint(0, 10, (xe.shape[0],))
    eval_s = seconds_per_call(lambda _: evaluate(m, xe, ye, device, args.precision, args.recon_weight), device, 0,
                              1) / xe.shape[0]
    del m, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return step_s, eval_s


def resave(src, dst):
    """Reads a weight file with this PyTorch and writes it again (for a file made by a newer one)."""
    try:
        d = torch.load(src, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - whatever torch.load raises, the answer is the same
        fail(f"{src}: not a capsnet weight file (torch.load: {str(e)[:120]})")
    if not isinstance(d, dict) or d.get("format") != capsmodel.FORMAT:
        fail(f"{src}: not a capsnet weight file")
    atomic_save(d, dst)
    print(f"wrote {dst} (torch {torch.__version__})")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "mnist"),
                    help="folder with the four IDX files (plain or .gz)")
    ap.add_argument("--dataset", choices=["mnist", "fashion-mnist"], default="mnist", help="recorded in the card")
    ap.add_argument("--out", required=False, help="output folder (metrics.jsonl, best.pt, last.pt)")
    ap.add_argument("--epochs", type=int, default=30, help="epochs (with --minutes: at most this many)")
    ap.add_argument("--minutes", type=float, default=0, help="plan the epochs to fit this many minutes (0 = off)")
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--schedule", choices=["paper", "fast"], default="paper")
    ap.add_argument("--lr", type=float, default=None, help="Adam rate (one-cycle: the peak); default 1e-3 paper, 3e-3 fast")
    ap.add_argument("--val", type=int, default=5000, help="hold out the last N training images (0 = none)")
    ap.add_argument("--ema-decay", type=float, default=0.0, help="weights' moving average as the model (0 = off)")
    ap.add_argument("--recon-weight", type=float, default=0.0005)
    ap.add_argument("--init", choices=capsmodel.INITS, default="torch",
                    help="initialisation as `capsnet train --init` (authors: the authors' code's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--ops-library", default=None, help="libcapsnet_ops.so (default: the build tree's)")
    ap.add_argument("--reference-routing", action="store_true", help="plain-PyTorch routing (no ops library)")
    ap.add_argument("--train-limit", type=int, default=0, help="use the first N training images only (tests)")
    ap.add_argument("--test-limit", type=int, default=0, help="score the first N test images only (tests)")
    ap.add_argument("--log-every", type=int, default=100, help="steps between 'train' records")
    ap.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    ap.add_argument("--resave", nargs=2, metavar=("IN", "OUT"), help="rewrite a weight file with this PyTorch and exit")
    args = ap.parse_args(argv)
    if args.resave:
        return args
    if not args.out:
        ap.error("--out is required")
    if args.epochs < 1 or args.batch_size < 1 or args.val < 0 or args.minutes < 0:
        ap.error("--epochs and --batch-size must be >= 1, --val and --minutes >= 0")
    if not 0 <= args.ema_decay < 1:
        ap.error("--ema-decay must be in [0, 1)")
    if args.lr is None:
        args.lr = 1e-3 if args.schedule == "paper" else 3e-3
    if args.precision is None:
        args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
    return args


def prepare_device(args):
    """The torch.device of --device (a GPU checked to exist); loads the ops library unless --reference-routing."""
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            fail("--device cuda but this PyTorch sees no GPU")
        torch.backends.cudnn.benchmark = True
    if not args.reference_routing:
        try:
            capsops.load_library(args.ops_library)
        except Exception as e:  # noqa: BLE001 - any failure to load is reported the same way
            fail(f"cannot load the ops library ({e}); build it (docs/gpu.md) or pass --reference-routing")
    return device


def load_mnist(folder):
    """(train images, train labels, test images, test labels): uint8 [N, 28, 28] and int64 [N]."""
    train_x, train_y = load_split(folder, "train")
    test_x, test_y = load_split(folder, "t10k")
    if train_x.shape[1:] != (28, 28) or test_x.shape[1:] != (28, 28):
        fail(f"{folder}: expected 28x28 images, got {list(train_x.shape[1:])}")
    return train_x, train_y, test_x, test_y


def refuse_previous_run(out, overwrite):
    """A folder that holds a run (metrics.jsonl) is replaced only with --overwrite, as the C++ tool does."""
    if os.path.exists(os.path.join(out, "metrics.jsonl")) and not overwrite:
        fail(f"{out} holds a previous run (metrics.jsonl); pass --overwrite to replace it, or choose another --out")


def main(argv=None):
    args = parse_args(argv if argv is not None else sys.argv[1:])
    if args.resave:
        return resave(*args.resave)
    refuse_previous_run(args.out, args.overwrite)
    device = prepare_device(args)
    train_x, train_y, test_x, test_y = load_mnist(args.data)
    if args.train_limit:
        train_x, train_y = train_x[:args.train_limit], train_y[:args.train_limit]
    if args.test_limit:
        test_x, test_y = test_x[:args.test_limit], test_y[:args.test_limit]
    if args.val >= train_x.shape[0]:
        fail(f"--val {args.val} leaves no training images (of {train_x.shape[0]})")
    n_train = train_x.shape[0] - args.val
    val_x, val_y = train_x[n_train:], train_y[n_train:]
    train_x, train_y = train_x[:n_train], train_y[:n_train]
    steps_per_epoch = math.ceil(n_train / args.batch_size)
    eval_images = val_x.shape[0] + test_x.shape[0]

    epochs, probe = args.epochs, None
    if args.minutes > 0:
        step_s, eval_s = time_probe(args, device, steps_per_epoch, eval_images)
        epoch_s = step_s * steps_per_epoch + eval_s * eval_images
        fit = max(1, int(args.minutes * 60 * 0.92 / epoch_s))
        epochs = min(args.epochs, fit)
        probe = {"step_ms": step_s * 1e3, "eval_ms_per_image": eval_s * 1e3, "epoch_s": epoch_s, "epochs_fit": fit}
        print(f"time probe: {step_s * 1e3:.2f} ms per step, {epoch_s:.1f} s per epoch with evaluation: "
              f"{epochs} epochs (of {args.epochs}) fit in {args.minutes:g} minutes", flush=True)
    total_steps = epochs * steps_per_epoch

    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    model = new_model(device, not args.reference_routing, args.init)
    opt = make_optimizer(model, args.lr, device)
    average = WeightAverage(model.parameters(), args.ema_decay) if args.ema_decay > 0 else None
    gx, gy = train_x.to(device), train_y.to(device)

    metrics = Metrics(os.path.join(args.out, "metrics.jsonl"), append=False)
    options = {k: v for k, v in vars(args).items() if k not in ("resave",)}
    options.update({"epochs_planned": epochs, "train_examples": n_train, "validation_size": args.val,
                    "schedule_steps": total_steps, "max_shift": MAX_SHIFT, "torch": torch.__version__,
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})
    metrics.write({"event": "start", "options": options, "probe": probe})
    command = "python3 apps/gpu/train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"CapsNet: {sum(p.numel() for p in model.parameters())} parameters, {n_train} examples per epoch, "
          f"batch {args.batch_size}, {total_steps} steps ({steps_per_epoch} per epoch), {options['device_name']}, "
          f"{args.precision}", flush=True)

    best = None  # (val accuracy, -val loss, epoch)
    step, t_train, t_start = 0, 0.0, time.perf_counter()
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        order = torch.randperm(n_train, device=device, generator=gen)
        shifts = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (2, n_train), device=device, generator=gen)
        seen, correct, loss_sum = 0, torch.zeros((), device=device), torch.zeros((), device=device)
        for k in range(0, n_train, args.batch_size):
            idx = order[k:k + args.batch_size]
            x = shifted(gx[idx].float().div_(255).unsqueeze(1), shifts[0, idx], shifts[1, idx])
            y = gy[idx]
            lr = learning_rate(args.schedule, args.lr, step, total_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            with autocast(device, args.precision):
                out = model(x, y)
            loss, margin, sse = losses(out, x, y, args.recon_weight)
            loss.backward()
            opt.step()
            step += 1
            if average:
                average.update(step)
            seen += x.shape[0]
            correct += (out.lengths.argmax(1) == y).sum()
            loss_sum += loss.detach() * x.shape[0]
            if step % args.log_every == 0:
                metrics.write({"event": "train", "step": step, "epoch": step / steps_per_epoch, "lr": lr,
                               "loss": loss.item(), "margin_loss": margin.item(), "reconstruction_loss": sse.item()})
        if device.type == "cuda":
            torch.cuda.synchronize()
        t_train += time.perf_counter() - t0
        train_acc, train_loss = correct.item() / seen, loss_sum.item() / seen
        if average:
            average.swap()
        scores = {}
        for split, (xs, ys) in (("val", (val_x, val_y)), ("test", (test_x, test_y))):
            if xs.shape[0] == 0:
                continue
            acc, loss_mean = evaluate(model, xs, ys, device, args.precision, args.recon_weight)
            scores[split] = (acc, loss_mean)
            metrics.write({"event": "eval", "split": split, "epoch": float(epoch), "step": step, "accuracy": acc,
                           "error": 1 - acc, "loss": loss_mean, "examples": xs.shape[0], "train_seconds": t_train,
                           "weights": "average" if average else "trained"})
        line = (f"epoch {epoch}: train loss {train_loss:.4f} accuracy {100 * train_acc:.2f}% "
                f"({seen / (time.perf_counter() - t0):.0f} img/s)")
        if "val" in scores:
            line += f" | val loss {scores['val'][1]:.4f} accuracy {100 * scores['val'][0]:.2f}%"
        line += f" | test loss {scores['test'][1]:.4f} accuracy {100 * scores['test'][0]:.2f}%"
        card = {"source": "apps/gpu/train.py (python/capsnet)", "dataset": args.dataset, "command": command,
                "seed": args.seed, "epoch": epoch, "epochs": epochs, "steps": step, "schedule": args.schedule,
                "lr": args.lr, "batch_size": args.batch_size, "ema_decay": args.ema_decay,
                "precision": args.precision, "device": options["device_name"], "torch": torch.__version__,
                "test_accuracy_logged": scores["test"][0]}
        if "val" in scores:
            card.update({"validation_size": args.val, "val_accuracy": scores["val"][0],
                         "selection": "best validation accuracy, ties: the lower validation loss"})
            key = (scores["val"][0], -scores["val"][1], epoch)
            if best is None or key[:2] > best[:2]:
                best = key
                save_weights(os.path.join(args.out, "best.pt"), model, step, card)
                metrics.write({"event": "best", "epoch": float(epoch), "step": step, "val_accuracy": key[0],
                               "path": os.path.join(args.out, "best.pt")})
                line += " (best)"
        if epoch == epochs:
            save_weights(os.path.join(args.out, "last.pt"), model, step, card)
        if average:
            average.swap()
        print(line, flush=True)
    seconds = time.perf_counter() - t_start
    metrics.write({"event": "end", "step": step, "seconds": seconds, "train_seconds": t_train,
                   "images_per_second": step and n_train * epochs / t_train})
    if best:
        print(f"best validation: epoch {best[2]} ({100 * best[0]:.2f}%) -> {os.path.join(args.out, 'best.pt')}")
    print(f"trained {epochs} epochs in {t_train:.1f} s ({n_train * epochs / t_train:.0f} img/s); "
          f"wrote {os.path.join(args.out, 'last.pt')}, metrics.jsonl", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
