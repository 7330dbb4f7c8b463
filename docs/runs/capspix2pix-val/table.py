#!/usr/bin/env python3
"""Markdown tables of the capspix2pix runs trained to validation, from DIR/NAME.json (copies of
runs/p2p-val-NAME/capspix2pix.json; NAME = caps-s1, cnn-s2, cnn9-s3, ...): one row per run, then the mean and
spread (min-max) per generator.   Usage: table.py [DIR] (default: this file's folder)"""
import glob, json, os, statistics, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
runs = []
for path in sorted(glob.glob(os.path.join(here, "*-s[0-9].json"))):
    j = json.load(open(path))
    v, t = j["validation"], j["test"]
    lc = t.get("label_consistency", {})
    runs.append(dict(name=os.path.basename(path)[: -len(".json")], params=j["generator_parameters"],
                     seed=j["train_seed"], steps=j["steps"], best_step=v["best_step"], val=v["best_l1"], l1=t["l1"],
                     psnr=t["psnr_db"], ssim=t["ssim"], div=t["diversity"], lc=lc.get("generated"),
                     real=lc.get("real"), ips=j["train_images_per_second"]))
pct = lambda x: "–" if x is None else f"{100 * x:.1f}%"
print("| run | G parameters | seed | steps (stopped) | best step | validation L1 | test L1 | PSNR dB | SSIM | diversity "
      "| label consistency | real images | img/s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in runs:
    print(f"| {r['name']} | {r['params']:,} | {r['seed']} | {r['steps']} | {r['best_step']} | {r['val']:.4f} | "
          f"{r['l1']:.4f} | {r['psnr']:.2f} | {r['ssim']:.3f} | {r['div']:.4f} | {pct(r['lc'])} | {pct(r['real'])} | "
          f"{r['ips']:.0f} |")
print()
keys = [("val", "validation L1", 4, 1), ("l1", "test L1", 4, 1), ("psnr", "PSNR dB", 2, 1), ("ssim", "SSIM", 3, 1),
        ("div", "diversity", 4, 1), ("lc", "label consistency %", 1, 100)]
print("| generator | runs | " + " | ".join(k[1] + ", mean (min–max)" for k in keys) + " |")
print("|---|---:|" + "---:|" * len(keys))
for gen in sorted({r["name"].rsplit("-s", 1)[0] for r in runs}):
    rs = [r for r in runs if r["name"].rsplit("-s", 1)[0] == gen]
    cells = []
    for k, _, digits, scale in keys:
        xs = [r[k] * scale for r in rs if r[k] is not None]
        cells.append("–" if not xs else f"{statistics.mean(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})")
    print(f"| {gen} | {len(rs)} | " + " | ".join(cells) + " |")
