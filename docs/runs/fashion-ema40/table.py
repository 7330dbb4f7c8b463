#!/usr/bin/env python3
"""Fashion-MNIST, 40-epoch one-cycle (peak 1e-3) with the weights' moving average, two seeds (fashion40-lane.sh).
Reads sN.metrics.jsonl beside this file; prints per seed the validation-chosen epoch (best validation accuracy of
the average, ties: lower validation loss, as best.pt) with its test accuracy, the last epoch's test accuracy (of
the average and of the trained weights), the mean and spread over finished seeds, and every fifth epoch's
validation / test.   Usage: table.py [DIR]  (DIR: another lane's folder under docs/runs with sN.metrics.jsonl)"""
import os, statistics, sys
here = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(here))
from epochs import epochs as read_epochs  # docs/runs/epochs.py: the validation rule
rows, curves = [], {}
for seed in (1, 2):
    path = os.path.join(here, f"s{seed}.metrics.jsonl")
    if not os.path.exists(path):
        continue
    run = read_epochs(path)
    if run is None:
        continue
    val, test, epochs, best, last = run["val"], run["test"], run["epochs"], run["best"], run["last"]
    rows.append(dict(seed=seed, epochs=last, best=best, val=val[best]["accuracy"], test=test[best]["accuracy"],
                     last=test[last]["accuracy"], last_trained=test[last].get("trained_accuracy", float("nan"))))
    curves[seed] = {e: (val[e]["accuracy"], test[e]["accuracy"]) for e in epochs}
print("| seed | epochs done | best validation (epoch) | its test accuracy | last epoch's test: average / trained weights |")
print("|---:|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['seed']} | {r['epochs']} | {100 * r['val']:.2f}% ({r['best']}) | {100 * r['test']:.2f}% | "
          f"{100 * r['last']:.2f}% / {100 * r['last_trained']:.2f}% |")
done = [r for r in rows if r["epochs"] == 40]
if done:
    t = [100 * r["test"] for r in done]
    print(f"\n{len(done)} finished seeds: test at the chosen epoch mean {statistics.mean(t):.2f}% "
          f"(min {min(t):.2f}, max {max(t):.2f})")
print("\n| epoch | " + " | ".join(f"s{s} val / test" for s in sorted(curves)) + " |")
print("|---:|" + "---:|" * len(curves))
last = max((max(c) for c in curves.values()), default=0)
for e in [e for e in range(1, last + 1) if e % 5 == 0 or e == 1 or e > last - 3]:
    cells = [f"{100 * curves[s][e][0]:.2f} / {100 * curves[s][e][1]:.2f}" if e in curves[s] else "" for s in sorted(curves)]
    print(f"| {e} | " + " | ".join(cells) + " |")
