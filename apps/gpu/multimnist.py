#!/usr/bin/env python3
"""Trains the paper's MultiMNIST CapsNet (python/capsnet, fused routing) on a GPU, on the C++ tool's pairs.

`capsnet multimnist` (docs/results.md, "MultiMNIST") at GPU speed: the same stream of generated pairs (pair n
is a pure function of (seed, n): this file ports capsnet/data/multimnist.cpp exactly, so step s trains on the
pairs [s B, (s + 1) B) that the C++ tool would use with the same seed and batch), the same fixed test pairs
(the test split, --test-seed 1001), the same model (the paper's CapsNet at 36x36: 3,200 primary capsules,
11,361,808 parameters), loss (margin on both classes + 0.0005 x each digit's squared error, the decoder
masked by each label in turn), metric (a pair is right when its two longest capsules are its two classes)
and learning rate (Adam, lr x --lr-decay per 60,000 pairs, smooth). MultiMNIST has no validation split:
the model reported and kept is the last one, as in the C++ lane (docs/runs/multimnist-10m).

Outputs in --out: metrics.jsonl (records as the C++ tool's: "start", "train", "eval" on the test pairs every
--eval-every steps and at the end, "end"), model.pt: the last weights as a `capsnet export` weight file (fp16)
whose card holds the training options, so that `capsnet multimnist --eval-only --checkpoint model.pt` scores
it on the C++ test pairs and draws the R:(a,b) L:(a,b) reconstruction figure. The device tool returns files
of at most 16 MiB and this model is 22.7 MB in fp16: with --part-mib (default 15) the file is written as
model.part0.pt, model.part1.pt, ... (tensors split between them) and `--join OUT PART...` puts them back
together (under Debian's PyTorch this also rewrites them for it).

--minutes M plans the run to fit: a timing probe sets the number of steps (at most --steps) and, with
--final-lr F, the decay per 60,000 pairs so that the rate ends at F x lr at the last planned step.

    python3 apps/gpu/multimnist.py --data data/mnist --out runs/gpu-multimnist-s1 --steps 400000 \\
        --minutes 9 --final-lr 0.05 --eval-every 20000 --seed 1 --ops-library build-cuda/capsnet/ops/libcapsnet_ops.so
    /usr/bin/python3 apps/gpu/multimnist.py --join runs/mm.pt out/model.part0.pt out/model.part1.pt
    build/bin/capsnet multimnist --eval-only --checkpoint runs/mm.pt --out runs/mm-eval

On a CPU (no --device cuda) it runs in fp32 and slowly: the tests use it on a few pairs.
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import (Metrics, atomic_save, autocast, capsmodel, fail, load_mnist,  # noqa: E402
                   make_optimizer, prepare_device, refuse_previous_run, seconds_per_call, shifted, weights_dict)

PAD = MAX_SHIFT = 4  # 28x28 digits padded to 36x36, each shifted by up to 4 px (MultiMnistOptions)
DECAY_PAIRS = 60000.0  # the C++ tool's lr decays per 60,000 pairs (kDecayImages)
PERMUTATION, PARTNER, SHIFT = 1, 2, 3  # hash purposes of capsnet/data/multimnist.cpp
PART_FORMAT = "capsnet-weights-part"


# ---- the generator: capsnet/data/multimnist.cpp, in numpy uint64 (wrapping) arithmetic ----

def _u64(x):
    return np.asarray(x, dtype=np.uint64)


def mix64(x):
    """splitmix64's finaliser on uint64 arrays (MultiMnist's mix64)."""
    with np.errstate(over="ignore"):
        x = _u64(x) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def hash3(seed, n, purpose):
    return mix64(mix64(mix64(_u64(seed)) ^ _u64(n)) ^ _u64(purpose))


def permute(i, n, key):
    """The bijection of [0, n) of MultiMnist's permute (4-round Feistel network, cycle walking), elementwise."""
    half = 1
    while (1 << (2 * half)) < n:
        half += 1
    h, mask = np.uint64(half), np.uint64((1 << half) - 1)
    x, key = _u64(i).copy(), np.broadcast_to(_u64(key), np.shape(i)).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        left, right, k = x[todo] >> h, x[todo] & mask, key[todo]
        for rnd in range(4):
            f = mix64(k ^ mix64((right << np.uint64(2)) | np.uint64(rnd))) & mask
            left, right = right, left ^ f
        x[todo] = (left << h) | right
        todo &= x >= np.uint64(n)
    return x.astype(np.int64)


class Pairs:
    """MultiMnist(source, seed): pair n of a split. images [N, 28, 28] uint8 (on the device the pairs are made
    on), labels [N]."""

    def __init__(self, images, labels, seed, overlay="add"):
        if overlay not in ("add", "max"):
            raise ValueError(f"overlay must be 'add' or 'max', got {overlay!r}")
        lab = labels.cpu().numpy().astype(np.int64)
        if len(set(lab.tolist())) < 2:
            raise ValueError("the source set needs digits of at least two classes to pair")
        self.images, self.labels_np, self.seed, self.overlay = images, lab, seed, overlay
        self.labels = labels.to(images.device)
        self.by_class = np.argsort(lab, kind="stable")
        self.class_begin = np.concatenate([[0], np.cumsum(np.bincount(lab, minlength=lab.max() + 1))])

    def choose(self, first, count):
        """(a, b, dx [count, 2], dy [count, 2]): the source indices and shifts of pairs first .. first + count - 1."""
        N = len(self.labels_np)
        n = np.arange(first, first + count, dtype=np.int64)
        a = permute(n % N, N, hash3(self.seed, (n // N).astype(np.uint64), PERMUTATION))
        ka = self.labels_np[a]
        begin, end = self.class_begin[ka], self.class_begin[ka + 1]
        r = (hash3(self.seed, n.astype(np.uint64), PARTNER) % (N - (end - begin)).astype(np.uint64)).astype(np.int64)
        b = self.by_class[np.where(r < begin, r, r + (end - begin))]
        span = np.uint64(2 * MAX_SHIFT + 1)
        shift = [(hash3(self.seed, n.astype(np.uint64), SHIFT + p) % span).astype(np.int64) - MAX_SHIFT
                 for p in range(4)]  # dx of digit 0, dy of digit 0, dx of digit 1, dy of digit 1
        return a, b, np.stack([shift[0], shift[2]], 1), np.stack([shift[1], shift[3]], 1)

    def batch(self, first, count):
        """(images [B, 1, 36, 36], digits [B, 2, 1, 36, 36], labels [B, 2]) in [0, 1], on the images' device."""
        a, b, dx, dy = self.choose(first, count)
        dev = self.images.device
        src = torch.from_numpy(np.stack([a, b], 1)).to(dev)  # [B, 2]
        d = F.pad(self.images[src.flatten()].float().div_(255).unsqueeze(1), (PAD,) * 4)  # [2B, 1, 36, 36]
        d = shifted(d, torch.from_numpy(dx).flatten().to(dev), torch.from_numpy(dy).flatten().to(dev), MAX_SHIFT)
        digits = d.view(count, 2, 1, d.shape[-2], d.shape[-1])
        images = digits.sum(1).clamp_max_(1.0) if self.overlay == "add" else digits.max(1).values
        return images, digits, self.labels[src]


def box_overlap(digits):
    """Per pair of ink boxes (pixels > 0): (iou, over_smaller, valid), as capsnet::data::box_overlap.
    digits: [B, 2, 1, S, S] or [B, 2, S, S]."""
    ink = digits.reshape(digits.shape[0], 2, digits.shape[-2], digits.shape[-1]) > 0
    boxes = []
    for axis in (3, 2):  # rows with ink (any over x), columns with ink
        has = ink.any(axis).cpu().numpy()  # [B, 2, S]
        first = has.argmax(2)
        last = has.shape[2] - 1 - has[:, :, ::-1].argmax(2)
        boxes.append((first, last, has.any(2)))
    (y0, y1, ok), (x0, x1, _) = boxes
    h = np.minimum(y1[:, 0], y1[:, 1]) - np.maximum(y0[:, 0], y0[:, 1]) + 1
    w = np.minimum(x1[:, 0], x1[:, 1]) - np.maximum(x0[:, 0], x0[:, 1]) + 1
    inter = np.where((h > 0) & (w > 0), h * w, 0).astype(np.float64)
    area = ((y1 - y0 + 1) * (x1 - x0 + 1)).astype(np.float64)  # [B, 2]
    valid = ok[:, 0] & ok[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(valid, inter / (area[:, 0] + area[:, 1] - inter), 0.0)
        smaller = np.where(valid, inter / area.min(1), 0.0)
    return iou, smaller, valid


# ---- the model's MultiMNIST loss and metric (apps/experiments/multimnist.cpp) ----

def forward_pair(model, images, labels):
    """(lengths [B, K], reconstructions [B, 2, S*S]): the decoder sees each label's capsule in turn."""
    out = model(images, labels[:, 0])
    rec_b = model.decoder(capsmodel.mask(out.digit_caps, labels[:, 1]))
    return out.lengths, torch.stack([out.reconstruction, rec_b], 1)


def pair_loss(lengths, recs, labels, digits, scale):
    """(total, margin, reconstruction): margin summed over classes with both labels present, + scale x the
    squared error of each digit's reconstruction, each averaged over the batch."""
    lengths = lengths.float()
    t = F.one_hot(labels[:, 0], lengths.shape[1]) + F.one_hot(labels[:, 1], lengths.shape[1])
    margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
    target = digits.flatten(2)  # [B, 2, S*S]
    sse = ((recs.float() - target) ** 2).sum(2).mean(0)  # [2]
    rec = scale * sse.sum()
    return margin + rec, margin, rec


def both_found(lengths, labels):
    """[B] bool: the two longest capsules are exactly the pair's two classes."""
    top = lengths.topk(2, 1).indices
    l0, l1 = labels[:, 0], labels[:, 1]
    return ((top[:, 0] == l0) & (top[:, 1] == l1)) | ((top[:, 0] == l1) & (top[:, 1] == l0))


@torch.no_grad()
def evaluate(model, pairs, count, device, precision, batch=500):
    """The C++ evaluate_multimnist: accuracy (both found), digit accuracy, mean loss, mean box overlaps."""
    model.eval()
    t0 = time.perf_counter()
    correct = found = 0
    loss_sum, iou_sum, smaller_sum, valid = 0.0, 0.0, 0.0, 0
    for start in range(0, count, batch):
        n = min(batch, count - start)
        x, d, y = pairs.batch(start, n)
        with autocast(device, precision):
            lengths, recs = forward_pair(model, x, y)
        lengths = lengths.float()
        loss_sum += pair_loss(lengths, recs, y, d, model.config["reconstruction_scale"])[0].item() * n
        correct += both_found(lengths, y).sum().item()
        top = lengths.topk(2, 1).indices
        found += (top.unsqueeze(1) == y.unsqueeze(2)).any(2).sum().item()
        iou, smaller, ok = box_overlap(d)
        iou_sum += iou.sum()
        smaller_sum += smaller.sum()
        valid += int(ok.sum())
    model.train()
    return {"accuracy": correct / count, "error": 1 - correct / count, "digit_accuracy": found / (2 * count),
            "loss": loss_sum / count, "examples": count, "overlap_iou": iou_sum / valid if valid else 0.0,
            "overlap_over_smaller": smaller_sum / valid if valid else 0.0, "seconds": time.perf_counter() - t0}


# ---- weight files in parts (the device tool returns files of at most 16 MiB) ----

def save_parts(path, model, step, card, part_mib):
    """`capsnet export`'s weight file (fp16) at path, or, when larger than part_mib MiB, parts
    path.part0.pt, ... each holding some tensors and everything else; returns the paths written."""
    base = weights_dict(model, step, card)
    state = base.pop("state_dict")
    limit = part_mib * 2 ** 20 if part_mib > 0 else float("inf")
    groups, sizes = [], []  # first fit, largest tensor first: few parts, none above the limit but a lone tensor
    for k in sorted(state, key=lambda k: -state[k].numel()):
        nbytes = state[k].numel() * state[k].element_size()
        fit = next((i for i, size in enumerate(sizes) if size + nbytes <= limit), None)
        if fit is None:
            groups.append([])
            sizes.append(0)
            fit = len(groups) - 1
        groups[fit].append(k)
        sizes[fit] += nbytes
    if len(groups) == 1:
        atomic_save(dict(base, state_dict=state), path)
        return [path]
    stem = path[:-3] if path.endswith(".pt") else path
    paths = []
    for i, keys in enumerate(groups):
        p = f"{stem}.part{i}.pt"
        atomic_save({"format": PART_FORMAT, "part": i, "parts": len(groups), "base": base,
                     "state_dict": {k: state[k] for k in keys}}, p)
        paths.append(p)
    return paths


def join_parts(out, parts):
    """Reassembles save_parts' parts into one weight file at out (written by this PyTorch)."""
    loaded = []
    for p in parts:
        try:
            d = torch.load(p, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - whatever torch.load raises, the answer is the same
            fail(f"{p}: not a weight-file part (torch.load: {str(e)[:120]})")
        if not isinstance(d, dict) or d.get("format") != PART_FORMAT:
            fail(f"{p}: not a weight-file part (written by apps/gpu/multimnist.py)")
        loaded.append((p, d))
    count = loaded[0][1]["parts"]
    have = sorted(d["part"] for _, d in loaded)
    if have != list(range(count)):
        fail(f"parts {have} given, the file has {count}: pass all of {', '.join(f'part{i}' for i in range(count))}")
    base = loaded[0][1]["base"]
    if any(d["base"] != base or d["parts"] != count for _, d in loaded):
        fail("the parts come from different files (their config, step or card differ)")
    state = {}
    for _, d in sorted(loaded, key=lambda pd: pd[1]["part"]):
        state.update(d["state_dict"])
    atomic_save(dict(base, state_dict=state), out)
    print(f"wrote {out} ({len(state)} tensors from {count} parts, torch {torch.__version__})")
    return 0


# ---- training ----

def new_model(args, device):
    config = dict(capsmodel.DEFAULT_CONFIG, image_size=28 + 2 * PAD, conv1_channels=args.conv1_channels,
                  primary_types=args.primary_types)
    return capsmodel.CapsNet(config, fused=not args.reference_routing).to(device)


def time_probe(args, device, pairs):
    """Seconds per training step and per evaluated pair, measured with a throwaway model."""
    m = new_model(args, device)
    opt = make_optimizer(m, 1e-4, device)
    scale = m.config["reconstruction_scale"]

    def step(k):
        x, d, y = pairs.batch(k * args.batch_size, args.batch_size)
        opt.zero_grad(set_to_none=True)
        with autocast(device, args.precision):
            lengths, recs = forward_pair(m, x, y)
        pair_loss(lengths, recs, y, d, scale)[0].backward()
        opt.step()

    step_s = seconds_per_call(step, device, 3, 10)
    probe = min(args.test_size, 1000)
    eval_s = seconds_per_call(lambda _: evaluate(m, pairs, probe, device, args.precision), device, 0, 1) / probe
    del m, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return step_s, eval_s


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "data", "mnist"), help="folder with the four MNIST IDX files (plain or .gz)")
    ap.add_argument("--out", help="output folder (metrics.jsonl, model.pt or its parts)")
    ap.add_argument("--steps", type=int, default=10000, help="optimizer steps (with --minutes: at most this many)")
    ap.add_argument("--minutes", type=float, default=0, help="plan the steps to fit this many minutes (0 = off)")
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-decay", type=float, default=0.96, help="learning-rate factor per 60,000 pairs, in (0, 1]")
    ap.add_argument("--final-lr", type=float, default=0.0,
                    help="instead of --lr-decay: the decay that ends the planned steps at this fraction of --lr")
    ap.add_argument("--eval-every", type=int, default=0, help="score the test pairs every N steps (0 = at the end)")
    ap.add_argument("--test-size", type=int, default=10000)
    ap.add_argument("--test-seed", type=int, default=1001)
    ap.add_argument("--overlay", choices=["add", "max"], default="add")
    ap.add_argument("--seed", type=int, default=1, help="seed of the model initialisation and of the training pairs")
    ap.add_argument("--conv1-channels", type=int, default=256, help="Conv1 channels (paper: 256; fewer for tests)")
    ap.add_argument("--primary-types", type=int, default=32, help="PrimaryCaps capsule types (paper: 32)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--ops-library", default=None, help="libcapsnet_ops.so (default: the build tree's)")
    ap.add_argument("--reference-routing", action="store_true", help="plain-PyTorch routing (no ops library)")
    ap.add_argument("--log-every", type=int, default=100, help="steps between 'train' records")
    ap.add_argument("--part-mib", type=float, default=15, help="split model.pt into parts of at most this (0 = never)")
    ap.add_argument("--overwrite", action="store_true", help="replace a previous run in --out")
    ap.add_argument("--join", nargs="+", metavar=("OUT", "PART"), help="join weight-file parts into OUT and exit")
    args = ap.parse_args(argv)
    if args.join:
        if len(args.join) < 2:
            ap.error("--join needs OUT and at least one PART")
        return args
    if not args.out:
        ap.error("--out is required")
    if args.steps < 1 or args.batch_size < 1 or args.test_size < 1 or args.eval_every < 0 or args.minutes < 0:
        ap.error("--steps, --batch-size and --test-size must be >= 1, --eval-every and --minutes >= 0")
    if not 0 < args.lr_decay <= 1 or not 0 <= args.final_lr <= 1:
        ap.error("--lr-decay must be in (0, 1], --final-lr in [0, 1]")
    if args.precision is None:
        args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
    return args


def main(argv=None):
    argv = argv if argv is not None else sys.argv[1:]
    args = parse_args(argv)
    if args.join:
        return join_parts(args.join[0], args.join[1:])
    refuse_previous_run(args.out, args.overwrite)
    device = prepare_device(args)
    train_x, train_y, test_x, test_y = load_mnist(args.data)
    try:
        train_pairs = Pairs(train_x.to(device), train_y, args.seed, args.overlay)
        test_pairs = Pairs(test_x.to(device), test_y, args.test_seed, args.overlay)
    except ValueError as e:
        fail(f"{args.data}: {e}")

    steps, probe = args.steps, None
    if args.minutes > 0:
        step_s, eval_s = time_probe(args, device, train_pairs)
        eval_total = eval_s * args.test_size
        per_step = step_s + (eval_total / args.eval_every if args.eval_every else 0)
        fit = max(1, int((args.minutes * 60 * 0.92 - eval_total) / per_step))
        steps = min(args.steps, fit)
        probe = {"step_ms": step_s * 1e3, "eval_ms_per_pair": eval_s * 1e3, "steps_fit": fit}
        print(f"time probe: {step_s * 1e3:.2f} ms per step, {eval_total:.1f} s per evaluation: {steps} steps "
              f"(of {args.steps}) fit in {args.minutes:g} minutes", flush=True)
    # lr x decay^(pairs / 60,000), in logarithms: a short run's decay per 60,000 pairs can underflow.
    log_decay = math.log(args.lr_decay)
    if args.final_lr > 0:  # lr x decay^(steps B / 60,000) = final_lr x lr
        log_decay = math.log(args.final_lr) * DECAY_PAIRS / (steps * args.batch_size)
    decay = math.exp(log_decay)

    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    model = new_model(args, device)
    scale = model.config["reconstruction_scale"]
    opt = make_optimizer(model, args.lr, device)
    metrics = Metrics(os.path.join(args.out, "metrics.jsonl"), append=False)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # What `capsnet multimnist --eval-only` reads from a checkpoint's options (MultiMnistTaskBase::data_config).
    train_options = {"task": "multimnist", "batch_size": args.batch_size, "seed": args.seed, "lr": args.lr,
                     "lr_decay": decay, "steps": steps,
                     "train_generator": {"seed": args.seed, "source_size": int(train_x.shape[0]), "pad": PAD,
                                         "max_shift": MAX_SHIFT, **({"overlay": "add"} if args.overlay == "add" else {})}}
    options = dict(vars(args), steps_planned=steps, lr_decay_used=decay, log_lr_decay=log_decay, torch=torch.__version__,
                   device_name=device_name)
    options.pop("join")
    metrics.write({"event": "start", "options": options, "probe": probe})
    command = "python3 apps/gpu/multimnist.py " + " ".join(argv)
    params = sum(p.numel() for p in model.parameters())
    print(f"MultiMNIST CapsNet: {params} parameters, batch {args.batch_size}, {steps} steps "
          f"({steps * args.batch_size} pairs), lr {args.lr:g} x {decay:.5g} per 60,000 pairs, {device_name}, "
          f"{args.precision}", flush=True)

    def test(step, t_train):
        r = evaluate(model, test_pairs, args.test_size, device, args.precision)
        metrics.write(dict(r, event="eval", split="test", step=step, epoch=step * args.batch_size / DECAY_PAIRS,
                           images_seen=step * args.batch_size, train_seconds=t_train))
        print(f"step {step} ({step * args.batch_size} pairs): test error {100 * r['error']:.2f}% "
              f"(digits found {100 * r['digit_accuracy']:.2f}%, loss {r['loss']:.4f}, {args.test_size} pairs)",
              flush=True)
        return r

    t_train, t0 = 0.0, time.perf_counter()
    correct, seen = torch.zeros((), device=device), 0
    result = None
    for step in range(steps):
        x, d, y = train_pairs.batch(step * args.batch_size, args.batch_size)
        lr = args.lr * math.exp(log_decay * step * args.batch_size / DECAY_PAIRS)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        with autocast(device, args.precision):
            lengths, recs = forward_pair(model, x, y)
        loss, margin, rec = pair_loss(lengths, recs, y, d, scale)
        loss.backward()
        opt.step()
        correct += both_found(lengths.detach(), y).sum()
        seen += x.shape[0]
        done = step + 1
        if done % args.log_every == 0:
            metrics.write({"event": "train", "step": done, "epoch": done * args.batch_size / DECAY_PAIRS, "lr": lr,
                           "loss": loss.item(), "margin_loss": margin.item(), "reconstruction_loss": rec.item(),
                           "accuracy": correct.item() / seen, "images_seen": done * args.batch_size})
            correct, seen = torch.zeros((), device=device), 0
        if (args.eval_every and done % args.eval_every == 0) or done == steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_train += time.perf_counter() - t0
            result = test(done, t_train)
            t0 = time.perf_counter()
    card = {"source": "apps/gpu/multimnist.py (python/capsnet)", "task": "multimnist", "dataset": "mnist",
            "command": command, "seed": args.seed, "steps": steps, "pairs": steps * args.batch_size,
            "precision": args.precision, "device": device_name, "torch": torch.__version__,
            "test_error_logged": result["error"], "test_pairs": args.test_size, "test_seed": args.test_seed,
            "train_options": train_options}
    written = save_parts(os.path.join(args.out, "model.pt"), model, steps, card, args.part_mib)
    metrics.write({"event": "end", "step": steps, "train_seconds": t_train,
                   "images_per_second": steps * args.batch_size / t_train if t_train else 0.0})
    print(f"trained {steps} steps ({steps * args.batch_size} pairs) in {t_train:.1f} s "
          f"({steps * args.batch_size / max(t_train, 1e-9):.0f} pairs/s); test error {100 * result['error']:.2f}%; "
          f"wrote {', '.join(written)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
