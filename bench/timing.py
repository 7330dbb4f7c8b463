"""Timing helpers shared by the bench/ programs (run as `python3 bench/NAME.py`, so this folder is on
sys.path): the micro-benchmarks' median, and the one measurement every plain-PyTorch peer of
`capsnet bench` makes, so that all peers are measured alike."""
import contextlib
import math
import os
import statistics
import time


def wall_times(fn, reps, warmup=0):
    """Wall time of each of `reps` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def median_seconds(fn, reps, warmup=1):
    """Median wall time of `reps` calls of fn, after `warmup` untimed calls."""
    return statistics.median(wall_times(fn, reps, warmup))


def add_peer_args(ap):
    """The command-line flags every peer takes (`capsnet bench` passes the same ones to each)."""
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (after 2 warm-up steps)")
    ap.add_argument("--infer-batches", type=int, default=5)
    ap.add_argument("--latency-runs", type=int, default=30)
    ap.add_argument("--routing-iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1)


def allocator():
    """"jemalloc" where this process has it mapped (`capsnet bench` preloads capsnet's into every peer),
    else "glibc malloc"."""
    try:
        with open("/proc/self/maps") as f:
            if any("/libjemalloc" in line for line in f):
                return "jemalloc"
    except OSError:
        pass
    return "glibc malloc"


def reset_peak_rss():
    """Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so each phase gets its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_mb(field):
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM) in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def capsnet_steps(model, opt, loss_fn, images, labels, autocast=contextlib.nullcontext, set_to_none=False):
    """A CapsNet peer's two timed closures: one optimiser step on (images, labels) under `autocast` that
    returns the loss, and the predicted classes of a batch (the longest digit capsule)."""

    def train_step():
        opt.zero_grad(set_to_none=set_to_none)
        with autocast():
            lengths, recon = model(images, labels)
            loss = loss_fn(lengths, recon, images, labels)
        loss.backward()
        opt.step()
        return loss.item()

    def predict(x):
        return model(x)[0].argmax(1)

    return train_step, predict


def measure_peer(train_step, model, predict, images, args, inference_ctx):
    """The figures of `capsnet bench` for one peer: `train_step()` timed over args.steps steps after 2
    warm-up steps (peak RSS of that phase), then, with `model` in eval mode (set once, outside the timed
    calls), `predict(x)` (classes [B] of images x) on args.infer_batches batches of `images`
    [B, 1, 28, 28] and args.latency_runs single images, inside one `inference_ctx()`. Returns the JSON
    fields shared by every peer."""
    B = images.shape[0]
    rss_before = rss_mb("VmRSS")
    reset_peak_rss()
    times = wall_times(train_step, args.steps, warmup=2)
    train_peak = rss_mb("VmHWM")

    model.eval()
    with inference_ctx():
        infer = wall_times(lambda: predict(images), args.infer_batches, warmup=1)
        one = images[:1].clone()
        lat = wall_times(lambda: predict(one), args.latency_runs, warmup=3)

    return {
        "batch_size": B, "routing_iters": args.routing_iters,
        "train_img_s": B / statistics.median(times), "infer_img_s": B / statistics.median(infer),
        "latency_b1_ms": 1000 * statistics.median(lat),
        "latency_b1_p90_ms": 1000 * sorted(lat)[math.ceil(0.9 * len(lat)) - 1],
        "train_peak_rss_mb": train_peak, "train_rss_growth_mb": train_peak - rss_before,
        "steps": args.steps, "allocator": allocator(),
    }
