#!/usr/bin/env python3
"""Two seeds of a `capsnet stn` lane on RTS distorted MNIST: by default this folder's ST-CNN (28x28 transformer
output, --small, 40 epochs, stn28-40-lane.sh); any other lane folder laid out the same way (e.g.
docs/runs/stcaps28-rts24, the ST-CapsNet at 24 epochs). Reads DIR/sN/stn.json (the test set scored once, at the
best-validation checkpoint), whose curve holds the validation accuracy per epoch; prints per seed the best
validation (epoch), the test error there and the transformer's statistics, the mean and spread of the test
error, and every fifth epoch's validation.
Usage: table.py [DIR]"""
import json, os, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows, curves = [], {}
for seed in (1, 2):
    path = os.path.join(here, f"s{seed}", "stn.json")
    if not os.path.exists(path):
        continue
    r = json.load(open(path))["results"][0]
    val = {round(c["epoch"]): c["accuracy"] for c in r["curve"] if c.get("split") == "val"}
    best_epoch = max(val, key=lambda e: (val[e], -e))  # stn keeps the first epoch of the best accuracy
    theta = r.get("theta", {})  # a model without a transformer has none
    rows.append((seed, r["best_val_accuracy"], best_epoch, r["test_error"],
                 theta.get("mean_abs_theta_minus_identity", float("nan")),
                 theta.get("mean_linear_determinant", float("nan")), r["train_seconds"]))
    curves[seed] = val
print("| seed | best validation (epoch) | test error there | mean abs(theta - I) | mean det theta | training s |")
print("|---:|---:|---:|---:|---:|---:|")
for s, v, e, t, th, det, sec in rows:
    print(f"| {s} | {100 * v:.2f}% ({e}) | **{100 * t:.2f}%** | {th:.3f} | {det:.3f} | {sec:.0f} |")
if len(rows) == 2:
    t = [100 * r[3] for r in rows]
    print(f"\nmean test error {sum(t) / 2:.3f}% (spread {abs(t[0] - t[1]):.2f} points: {min(t):.2f}-{max(t):.2f})")
print("\n| epoch | " + " | ".join(f"s{s} validation" for s in curves) + " |")
print("|---:|" + "---:|" * len(curves))
for e in sorted(set().union(*curves.values())):
    if e % 5 == 0 or e == 1:
        print(f"| {e} | " + " | ".join(f"{100 * curves[s][e]:.2f}%" if e in curves[s] else "" for s in curves) + " |")
