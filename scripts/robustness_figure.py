#!/usr/bin/env python3
"""Accuracy vs warp severity for every model of one or more `capsnet affine` runs (their affine.json).

Usage: robustness_figure.py OUT.svg RUN/affine.json [RUN2/affine.json ...]

One panel per warp family (rotation, shear, scale; "translation only" is every panel's first point at
severity 0; the two combined settings are a fourth panel at x = 1 and 2). One line per model: the mean
over the runs given (e.g. seeds), with a bar from the lowest to the highest run where there are several.
Prints the table it draws (mean, and min-max over the runs), led by the translated test set the models were
trained for; the baseline CNN without max-pooling is "cnn-nopool". With exactly two models also the difference of
their means and whether it is beyond the seed spread (every run of one model above every run of the other).
"""
import json
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
TRANSLATED = "translated test (the training placement)"  # the table's first row; not drawn
PANELS = [("rotation", "rotation ± (degrees)"), ("shear", "shear ±"), ("scale", "scale 1 ± d per axis"),
          ("combined", "combined: 1 = affNIST-style, 2 = shear ±0.2")]


def load(paths):
    sets, acc = None, {}  # acc[model][set name] = [accuracy per run]
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        sets = report["robustness_sets"]
        for row in report["results"]:
            # The baseline CNN without max-pooling (--cnn-no-pool) is its own model: "cnn-nopool".
            model = row["model"] + ("-nopool" if row.get("config", {}).get("pooling") is False else "")
            for name, a in row.get("robustness", {}).items():
                acc.setdefault(model, {}).setdefault(name, []).append(100 * a)
            if "robustness" in row and "translated_mnist_accuracy" in row:
                acc[model].setdefault(TRANSLATED, []).append(100 * row["translated_mnist_accuracy"])
    return sets, acc


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, paths = sys.argv[1], sys.argv[2:]
    sets, acc = load(paths)
    models = sorted(acc)
    pair = len(models) == 2  # two models: their difference, and whether it is beyond the seed spread
    extra = [f"{models[0]} − {models[1]}", "beyond the seed spread"] if pair else []
    print("| set | " + " | ".join(models + extra) + " |")
    print("|---|" + "---:|" * len(models + extra))
    rows = ([{"name": TRANSLATED}] if all(TRANSLATED in acc[m] for m in models) else []) + sets
    for s in rows:
        cells = []
        for m in models:
            v = acc[m][s["name"]]
            mean = sum(v) / len(v)
            cells.append(f"{mean:.2f}%" + (f" ({min(v):.2f}–{max(v):.2f})" if len(v) > 1 else ""))
        if pair:
            a, b = acc[models[0]][s["name"]], acc[models[1]][s["name"]]
            cells.append(f"{sum(a) / len(a) - sum(b) / len(b):+.2f}")
            # Every run of one model above every run of the other (needs two runs of each to mean anything).
            separated = min(a) > max(b) or min(b) > max(a)
            cells.append(("yes" if separated else "no") if len(a) > 1 and len(b) > 1 else "one run")
        print(f"| {s['name']} | " + " | ".join(cells) + " |")

    ys = [a for m in acc.values() for v in m.values() for a in v]
    y0 = max(0.0, 10 * int(min(ys) / 10) - 10) if ys else 0.0
    pw, ph, ml, mt, gap = 260, 220, 50, 40, 30
    width = ml + len(PANELS) * (pw + gap) + 10
    height = mt + ph + 70
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>']
    none = next((s for s in sets if s["family"] == "none"), None)
    for p, (family, xlabel) in enumerate(PANELS):
        x_off = ml + p * (pw + gap)
        points = ([none] if none and family != "combined" else []) + [s for s in sets if s["family"] == family]
        xs = [s["severity"] for s in points]
        xmax = max(xs) if xs else 1
        X = lambda x: x_off + pw * x / xmax
        Y = lambda a: mt + ph * (100 - a) / (100 - y0)
        parts.append(f'<rect x="{x_off}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
        for a in range(int(y0), 101, 10):
            parts.append(f'<line x1="{x_off}" x2="{x_off + pw}" y1="{Y(a):.1f}" y2="{Y(a):.1f}" stroke="#eee"/>')
            if p == 0:
                parts.append(f'<text x="{x_off - 6}" y="{Y(a) + 4:.1f}" text-anchor="end">{a}%</text>')
        for x in xs:
            parts.append(f'<text x="{X(x):.1f}" y="{mt + ph + 14}" text-anchor="middle">{x:g}</text>')
        parts.append(f'<text x="{x_off + pw / 2}" y="{mt + ph + 32}" text-anchor="middle">{xlabel}</text>')
        for k, m in enumerate(models):
            color = COLORS[k % len(COLORS)]
            coords = []
            for s in points:
                v = acc[m][s["name"]]
                mean = sum(v) / len(v)
                coords.append((X(s["severity"]), Y(mean)))
                if len(v) > 1:
                    parts.append(f'<line x1="{X(s["severity"]):.1f}" x2="{X(s["severity"]):.1f}" y1="{Y(min(v)):.1f}" '
                                 f'y2="{Y(max(v)):.1f}" stroke="{color}"/>')
            parts.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
                color, " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)))
            for x, y in coords:
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
    for k, m in enumerate(models):
        parts.append(f'<rect x="{ml + 130 * k}" y="{height - 18}" width="12" height="4" fill="{COLORS[k % len(COLORS)]}"/>'
                     f'<text x="{ml + 130 * k + 16}" y="{height - 13}">{m}</text>')
    parts.append(f'<text x="{ml}" y="18" font-size="13">test accuracy under increasingly strong warps '
                 f'({len(paths)} run{"s" if len(paths) > 1 else ""}; bars: min–max)</text></svg>')
    with open(out, "w") as f:
        f.write("\n".join(parts) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
