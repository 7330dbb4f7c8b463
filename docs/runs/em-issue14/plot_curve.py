#!/usr/bin/env python3
"""Accuracy vs images seen for the issue-14 EM runs, as a dependency-free SVG.

Usage: plot_curve.py [--ymin Y] [--test-only] OUT.svg LABEL=RUN_DIR [LABEL=RUN_DIR ...]
Each RUN_DIR holds the metrics.jsonl of a `capsnet em` run. Lines: the on-the-fly training accuracy of
each "train" record (mean over its log window; first epoch, so every batch is unseen data); dots: the
test accuracy of each "eval" record. --ymin Y starts the accuracy axis at Y (e.g. 0.8, to tell 98% from
99%); --test-only draws the test accuracies joined by lines and no training curve.
"""
import json
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]


def read(run_dir):
    train, evals, batch = [], [], None
    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == "start":
                batch = r["train"]["batch_size"]
            elif r.get("event") == "train" and "accuracy" in r:
                train.append((r["step"] * batch, r["accuracy"]))
            elif r.get("event") == "eval":
                evals.append((r["step"] * batch, r["accuracy"]))
    return train, evals


def main():
    args = sys.argv[1:]
    ymin, test_only = 0.0, False
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--ymin":
            ymin = float(args.pop(0))
        elif flag == "--test-only":
            test_only = True
        else:
            sys.exit(f"plot_curve.py: unknown flag {flag}")
    out, runs = args[0], [a.split("=", 1) for a in args[1:]]
    data = [(label, *read(d)) for label, d in runs]
    if test_only:
        data = [(label, evals, evals) for label, _, evals in data]
    W, H, L, R, T, B = 720, 380, 60, 250, 20, 50
    xmax = max(max(x for x, _ in t + e) for _, t, e in data)
    sx = lambda x: L + (W - L - R) * x / xmax
    sy = lambda y: T + (H - T - B) * (1 - (max(y, ymin) - ymin) / (1 - ymin))
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>']
    for k in range(11):
        y = ymin + (1 - ymin) * k / 10
        s.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{W - R}" y2="{sy(y):.1f}" stroke="#ddd"/>')
        s.append(f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{100 * y:g}%</text>')
    for k in range(6):
        x = xmax * k / 5
        s.append(f'<text x="{sx(x):.1f}" y="{H - B + 18}" text-anchor="middle">{int(x):,}</text>')
    s.append(f'<text x="{(L + W - R) / 2:.1f}" y="{H - 12}" text-anchor="middle">images seen</text>')
    s.append(f'<text x="14" y="{(T + H - B) / 2:.1f}" transform="rotate(-90 14 {(T + H - B) / 2:.1f})" '
             'text-anchor="middle">accuracy</text>')
    for n, (label, train, evals) in enumerate(data):
        c = COLORS[n % len(COLORS)]
        pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in train)
        s.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1.8"/>')
        for x, y in evals:
            s.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="{c}"/>')
        ly = T + 16 + 20 * n
        s.append(f'<line x1="{W - R + 12}" y1="{ly - 4}" x2="{W - R + 32}" y2="{ly - 4}" stroke="{c}" stroke-width="2"/>')
        final = f" ({100 * evals[-1][1]:.1f}%)" if evals else ""
        s.append(f'<text x="{W - R + 38}" y="{ly}">{label}{final}</text>')
    ly = T + 16 + 20 * len(data) + 10
    if test_only:
        s.append(f'<text x="{W - R + 12}" y="{ly}" fill="#555">dots: test accuracy (10,000)</text>')
        s.append(f'<text x="{W - R + 12}" y="{ly + 16}" fill="#555">label: the last one</text>')
    else:
        s.append(f'<text x="{W - R + 12}" y="{ly}" fill="#555">line: training batches</text>')
        s.append(f'<text x="{W - R + 12}" y="{ly + 16}" fill="#555">(on the fly, unseen)</text>')
        s.append(f'<text x="{W - R + 12}" y="{ly + 32}" fill="#555">dot: test accuracy</text>')
    s.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(s) + "\n")


if __name__ == "__main__":
    main()
