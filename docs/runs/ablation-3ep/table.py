#!/usr/bin/env python3
"""Routing-ablation table from DIR/NAME.metrics.jsonl (NAME = r1-recon-s1, r3-norecon-s2, ...: copies of
runs/abl-NAME/metrics.jsonl): per run the best validation epoch (the run's own `best` record) and the test accuracy
of that epoch, then mean and range per configuration.   Usage: table.py [DIR] (default: this file's folder)"""
import glob, json, os, statistics, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
paper = {("1", "norecon"): 0.34, ("1", "recon"): 0.29, ("3", "norecon"): 0.35, ("3", "recon"): 0.25}
runs = []
for path in sorted(glob.glob(os.path.join(here, "*.metrics.jsonl"))):
    name = os.path.basename(path)[: -len(".metrics.jsonl")]
    recs = [json.loads(l) for l in open(path) if l.strip()]
    best = [r for r in recs if r["event"] == "best"]
    ends = [r for r in recs if r["event"] == "end"]
    if not best or not ends:
        continue  # not finished
    step = ends[-1]["best_step"]
    val = {r["step"]: r for r in recs if r["event"] == "eval" and r["split"] == "val"}
    test = {r["step"]: r for r in recs if r["event"] == "eval" and r["split"] == "test"}
    last = max(test)
    r_, recon, seed = name.split("-")
    runs.append(dict(name=name, r=r_[1:], recon=recon, seed=seed[1:], epoch=val[step]["epoch"],
                     val=val[step]["accuracy"], test=test[step]["accuracy"], last=test[last]["accuracy"],
                     ips=max(e["images_per_second"] for e in ends)))
print("| run | r | reconstruction | seed | best validation (epoch) | its test error | last epoch's test error | img/s |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for x in runs:
    print(f"| {x['name']} | {x['r']} | {'yes' if x['recon'] == 'recon' else 'no'} | {x['seed']} | "
          f"{100 * x['val']:.2f}% ({x['epoch']:.0f}) | {100 * (1 - x['test']):.2f}% | {100 * (1 - x['last']):.2f}% | "
          f"{x['ips']:.0f} |")
print()
print("| r | reconstruction | runs | test error at the validation-chosen epoch, mean (min–max) | at the last epoch | "
      "paper (Table 1, mean of 3 trials) |")
print("|---:|---|---:|---:|---:|---:|")
span = lambda xs: f"{statistics.mean(xs):.2f}% ({min(xs):.2f}–{max(xs):.2f}%)"
for key in sorted({(x["r"], x["recon"]) for x in runs}):
    sel = [x for x in runs if (x["r"], x["recon"]) == key]
    print(f"| {key[0]} | {'yes' if key[1] == 'recon' else 'no'} | {len(sel)} | "
          f"{span([100 * (1 - x['test']) for x in sel])} | {span([100 * (1 - x['last']) for x in sel])} | "
          f"{paper.get(key, float('nan')):.2f}% |")
