#!/usr/bin/env python3
"""Test error per epoch (log scale) of one or more `capsnet train` runs, with the published anchors
drawn as horizontal lines, and the time-to-accuracy table read off the same metrics.

Usage: convergence_figure.py OUT.svg LABEL=RUN_DIR/metrics.jsonl [LABEL=...] [--table OUT.md]

Times are wall-clock seconds from the run's first "start" record to the first test "eval" record at
or above each accuracy (the records' "time" stamps), and the training seconds of the steps alone
("train_seconds"); a resumed run adds its segments' training seconds. A run with a validation split
(`capsnet train --val N`) also has "eval" records with "split": "val": they are drawn dashed in the
run's colour, and the table names the epoch the validation picked (best.pt) with its test accuracy.
Options: --pause-seconds LABEL=S[@EPOCH] subtracts S seconds of a stopped process from the times of
that run's evaluations after EPOCH (default: all).
"""
import math
import sys

from svg_io import plot_frame, records, write_svg

ANCHORS = [  # (test error %, label) for MNIST: the paper and the best verified reimplementations
    (0.25, "paper 0.25%"),
    (0.30, "best reimplementations 0.30%"),
    (0.34, "XifengGuo mean of 50 epochs 0.34%"),
]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
THRESHOLDS = [0.99, 0.995, 0.996, 0.997]


def read_run(path):
    evals, val, start_time, segment_base, last_train_seconds = [], [], None, 0.0, 0.0
    for r in records(path):
        if r.get("event") == "start":
            if start_time is None:
                start_time = r.get("time")
            segment_base += last_train_seconds  # a resumed segment counts its steps from 0
            last_train_seconds = 0.0
        elif r.get("event") == "eval" and "accuracy" in r:
            last_train_seconds = r.get("train_seconds", 0.0)
            e = {"epoch": r["epoch"], "accuracy": r["accuracy"], "loss": r.get("loss", 0.0),
                 "wall": (r["time"] - start_time) if start_time and "time" in r else None,
                 "train": segment_base + last_train_seconds}
            (val if r.get("split") == "val" else evals).append(e)
    return evals, val


def svg(runs, out):
    W, H, L, R, T, B = 640, 400, 70, 20, 20, 50
    max_epoch = max(e["epoch"] for _, ev, _ in runs for e in ev)
    errors = [100 * (1 - e["accuracy"]) for _, ev, va in runs for e in ev + va] + [a for a, _ in ANCHORS]
    lo, hi = math.log10(min(errors) * 0.8), math.log10(max(errors) * 1.2)
    x = lambda ep: L + (W - L - R) * ep / max_epoch
    y = lambda err: T + (H - T - B) * (hi - math.log10(err)) / (hi - lo)
    parts = plot_frame(W, H, L, R, T, B)
    for err in [0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0]:
        if lo <= math.log10(err) <= hi:
            parts.append(f'<line x1="{L - 4}" y1="{y(err):.1f}" x2="{W - R}" y2="{y(err):.1f}" stroke="#eee"/>')
            parts.append(f'<text x="{L - 6}" y="{y(err) + 4:.1f}" text-anchor="end">{err:g}%</text>')
    step = max(1, round(max_epoch / 10))
    for ep in range(0, int(max_epoch) + 1, step):
        parts.append(f'<text x="{x(ep):.1f}" y="{H - B + 16}" text-anchor="middle">{ep}</text>')
    parts.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">epoch</text>')
    parts.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 16 {(T + H - B) / 2})">'
                 'test error (log scale)</text>')
    for err, label in ANCHORS:
        parts.append(f'<line x1="{L}" y1="{y(err):.1f}" x2="{W - R}" y2="{y(err):.1f}" stroke="#999" stroke-dasharray="5,4"/>')
        parts.append(f'<text x="{W - R - 4}" y="{y(err) - 3:.1f}" text-anchor="end" fill="#666">{label}</text>')
    for i, (label, ev, va) in enumerate(runs):
        c = COLORS[i % len(COLORS)]
        if va:
            pts = " ".join(f"{x(e['epoch']):.1f},{y(100 * (1 - e['accuracy'])):.1f}" for e in va)
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.5" stroke-dasharray="4,3"/>')
        pts = " ".join(f"{x(e['epoch']):.1f},{y(100 * (1 - e['accuracy'])):.1f}" for e in ev)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        for e in ev:
            parts.append(f'<circle cx="{x(e["epoch"]):.1f}" cy="{y(100 * (1 - e["accuracy"])):.1f}" r="2.5" fill="{c}"/>')
        parts.append(f'<line x1="{L + 10}" y1="{T + 14 + 16 * i}" x2="{L + 30}" y2="{T + 14 + 16 * i}" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{L + 36}" y="{T + 18 + 16 * i}">{label}{" (dashed: validation)" if va else ""}</text>')
    write_svg(parts, out)


def picked(ev, va):
    """The epoch best.pt holds: highest validation accuracy, ties to the lower loss, then the earlier."""
    if not va:
        return None
    best = va[0]
    for e in va[1:]:
        if e["accuracy"] > best["accuracy"] or (e["accuracy"] == best["accuracy"] and e["loss"] < best["loss"]):
            best = e
    test = next((t for t in ev if t["epoch"] == best["epoch"]), None)
    return best, test


def table(runs):
    fmt = lambda s: "–" if s is None else f"{s / 60:.1f} min"
    rows = ["| run | epochs | final test accuracy | picked on validation (val / test) | " +
            " | ".join(f"to {100 * t:g}% (wall / train)" for t in THRESHOLDS) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(THRESHOLDS)]
    for label, ev, va in runs:
        p = picked(ev, va)
        test_at_pick = "?" if p is None or p[1] is None else f"{100 * p[1]['accuracy']:.2f}%"
        pick = "–" if p is None else f"epoch {p[0]['epoch']:g}: {100 * p[0]['accuracy']:.2f}% / {test_at_pick}"
        cells = []
        for t in THRESHOLDS:
            hit = next((e for e in ev if e["accuracy"] >= t), None)
            cells.append("not reached" if hit is None else f"{fmt(hit['wall'])} / {fmt(hit['train'])} (epoch {hit['epoch']:g})")
        rows.append(f"| {label} | {ev[-1]['epoch']:g} | {100 * ev[-1]['accuracy']:.2f}% | {pick} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main():
    args = sys.argv[1:]
    table_out = None
    if "--table" in args:
        i = args.index("--table")
        table_out = args[i + 1]
        del args[i:i + 2]
    if len(args) < 2:
        sys.exit(__doc__)
    pauses = {}
    while "--pause-seconds" in args:
        i = args.index("--pause-seconds")
        label, spec = args[i + 1].split("=", 1)
        seconds, _, after = spec.partition("@")
        pauses[label] = (float(seconds), float(after) if after else -1.0)
        del args[i:i + 2]
    runs = []
    for a in args[1:]:
        label, path = a.split("=", 1)
        ev, va = read_run(path)
        if not ev:
            sys.exit(f"{path}: no eval records")
        if label in pauses:
            seconds, after = pauses[label]
            for e in ev + va:
                if e["epoch"] > after:
                    e["train"] -= seconds
                    if e["wall"] is not None:
                        e["wall"] -= seconds
        runs.append((label, ev, va))
    svg(runs, args[0])
    t = table(runs)
    print(t, end="")
    if table_out:
        with open(table_out, "w") as f:
            f.write(t)


if __name__ == "__main__":
    main()
