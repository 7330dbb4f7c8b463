#!/usr/bin/env python3
"""One-change variants of the 40-epoch one-cycle MNIST recipe against the recipe itself (runs/mnist-val40-s*:
reconstruction weight 0.0005, LibTorch's initialisation), same validation split and seeds. Reads
docs/runs/mnist-val40-s{1,2}.metrics.jsonl and each variant's DIR/s{1,2}.metrics.jsonl; prints per run the
validation-chosen epoch (best validation accuracy, ties: lower validation loss, as best.pt) with its test
accuracy, the last epoch's test accuracy, and per-epoch validation / test.
Usage: table.py [LABEL=DIR ...]   (default: "recon 0.01=docs/runs/mnist-rs01", the authors' reconstruction
weight; e.g. table.py "init authors=docs/runs/mnist-authors-init")"""
import os, statistics, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(here))
from epochs import epochs as read_epochs  # docs/runs/epochs.py: the validation rule
variants = [a.split("=", 1) for a in sys.argv[1:]] or [["recon 0.01", here]]
BASE = "recipe"
runs = {(BASE, s): os.path.join(here, "..", f"mnist-val40-s{s}.metrics.jsonl") for s in (1, 2)}
for label, d in variants:
    runs.update({(label, s): os.path.join(d, f"s{s}.metrics.jsonl") for s in (1, 2)})
rows, curves = [], {}
for (scale, seed), path in runs.items():
    if not os.path.exists(path):
        continue
    run = read_epochs(path)
    if run is None:
        continue
    val, test, epochs, best, last = run["val"], run["test"], run["epochs"], run["best"], run["last"]
    rows.append(dict(scale=scale, seed=seed, epochs=last, best=best, val=val[best]["accuracy"],
                     test=test[best]["accuracy"], last=test[last]["accuracy"]))
    curves[(scale, seed)] = [(e, val[e]["accuracy"], test[e]["accuracy"]) for e in epochs]
print("| run | seed | epochs done | best validation (epoch) | its test accuracy | last epoch's test |")
print("|---|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['scale']} | {r['seed']} | {r['epochs']} | {100 * r['val']:.2f}% ({r['best']}) | "
          f"{100 * r['test']:.2f}% | {100 * r['last']:.2f}% |")
print()
for scale in [BASE] + [label for label, _ in variants]:
    sel = [r for r in rows if r["scale"] == scale and r["epochs"] == 40]
    if sel:
        t = [100 * r["test"] for r in sel]
        print(f"{scale}: {len(sel)} finished runs, test at the chosen epoch mean {statistics.mean(t):.3f}% "
              f"(min {min(t):.2f}, max {max(t):.2f})")
print()
keys = sorted(curves)
print("| epoch | " + " | ".join(f"{k[0]} s{k[1]} val / test" for k in keys) + " |")
print("|---:|" + "---:|" * len(keys))
byepoch = {k: {e: (v, t) for e, v, t in c} for k, c in curves.items()}
last = max(e for c in curves.values() for e, _, _ in c)
for e in [e for e in range(1, last + 1) if e % 5 == 0 or e > last - 6]:
    cells = [f"{100 * byepoch[k][e][0]:.2f} / {100 * byepoch[k][e][1]:.2f}" if e in byepoch[k] else "" for k in keys]
    print(f"| {e} | " + " | ".join(cells) + " |")
