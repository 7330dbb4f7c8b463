#!/usr/bin/env python3
"""MultiMNIST error vs training pairs seen, for one or more `capsnet multimnist` runs.

Usage: multimnist_curve.py OUT.svg LABEL=RUN/metrics.jsonl [LABEL=...]

Per run, two series from the metrics log:
- solid line with dots: the "eval" records (the fixed generated test pairs, model in eval mode);
- thin dashed line: the "train" records' "accuracy", the on-the-fly rate over each logging window.
  Every training pair is new (the generator never repeats one below 60M), so these are held-out
  pairs too, scored before the step that trains on them; but in training mode (the CNN's dropout is
  on, which makes its dashed line pessimistic; the CapsNet has no dropout or batch norm).
The paper's results after 60M pairs (CapsNet 5.2%, baseline CNN 8.1%) are drawn as horizontal lines.
Prints each run's eval points as a table.
"""
import sys

from svg_io import plot_frame, records, write_svg

ANCHORS = [(5.2, "paper CapsNet 5.2% (60M pairs)"), (8.1, "paper baseline CNN 8.1% (60M pairs)")]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def read_run(path):
    evals, windows = [], []
    batch = None
    for r in records(path):
        if r.get("event") == "start":
            batch = r.get("train", {}).get("batch_size", batch)
        elif r.get("event") == "train" and "accuracy" in r:
            windows.append((r["images_seen"], 100 * (1 - r["accuracy"])))
        elif r.get("event") == "eval" and "accuracy" in r and batch:
            evals.append((r["step"] * batch, 100 * (1 - r["accuracy"]), r.get("examples")))
    return evals, windows


def svg(runs, out):
    W, H, L, R, T, B = 680, 420, 60, 20, 20, 50
    max_x = max([x for _, ev, win in runs for x, *_ in ev + win])
    x = lambda v: L + (W - L - R) * v / max_x
    y = lambda err: T + (H - T - B) * (100 - err) / 100
    p = plot_frame(W, H, L, R, T, B)
    for err in range(0, 101, 10):
        p.append(f'<line x1="{L - 4}" y1="{y(err):.1f}" x2="{W - R}" y2="{y(err):.1f}" stroke="#eee"/>')
        p.append(f'<text x="{L - 8}" y="{y(err) + 4:.1f}" text-anchor="end">{err}%</text>')
    step = 20000 if max_x <= 200000 else 50000
    for v in range(0, int(max_x) + 1, step):
        p.append(f'<text x="{x(v):.1f}" y="{H - B + 16}" text-anchor="middle">{v // 1000}k</text>')
    p.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">training pairs seen</text>')
    p.append(f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})" '
             f'text-anchor="middle">error (both digits)</text>')
    for k, (err, label) in enumerate(ANCHORS):  # labels at opposite ends: the two lines are close
        p.append(f'<line x1="{L}" y1="{y(err):.1f}" x2="{W - R}" y2="{y(err):.1f}" stroke="#888" stroke-dasharray="2,3"/>')
        anchor, tx = ("end", W - R - 4) if k == 0 else ("start", L + 6)
        p.append(f'<text x="{tx}" y="{y(err) - 3:.1f}" text-anchor="{anchor}" fill="#666">{label}</text>')
    for k, (label, ev, win) in enumerate(runs):
        c = COLORS[k % len(COLORS)]
        if win:
            pts = " ".join(f"{x(a):.1f},{y(e):.1f}" for a, e in win)
            p.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1" stroke-dasharray="4,3" opacity="0.6"/>')
        if ev:
            pts = " ".join(f"{x(a):.1f},{y(e):.1f}" for a, e, _ in ev)
            p.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
            for a, e, _ in ev:
                p.append(f'<circle cx="{x(a):.1f}" cy="{y(e):.1f}" r="3" fill="{c}"/>')
        ly = T + 14 + 16 * k
        p.append(f'<line x1="{L + 250}" y1="{ly - 4}" x2="{L + 270}" y2="{ly - 4}" stroke="{c}" stroke-width="2"/>')
        p.append(f'<text x="{L + 276}" y="{ly}">{label}: test pairs (dots); dashed: on the fly</text>')
    write_svg(p, out)


def main(argv):
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        sys.exit(__doc__)
    runs = []
    for arg in argv[2:]:
        label, path = arg.split("=", 1)
        ev, win = read_run(path)
        runs.append((label, ev, win))
        print(f"{label}: " + ", ".join(f"{a // 1000}k pairs {e:.2f}% ({n} test pairs)" for a, e, n in ev))
    svg(runs, argv[1])
    print(f"wrote {argv[1]}")


if __name__ == "__main__":
    main(sys.argv)
