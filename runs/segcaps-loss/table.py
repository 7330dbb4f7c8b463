#!/usr/bin/env python3
"""Markdown table of runs/segcaps-loss/*/segcaps.json: Dice at 0.5 and at the validation-chosen threshold."""
import glob, json, os
import sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = {}
# runs/segcaps-loss/NAME/segcaps.json, or the copies in docs/runs/segcaps-loss/NAME.segcaps.json
paths = glob.glob(os.path.join(here, "*", "segcaps.json")) + glob.glob(os.path.join(here, "*.segcaps.json"))
for path in sorted(paths):
    j = json.load(open(path))
    base = os.path.basename(path)
    name = base[: -len(".segcaps.json")] if base != "segcaps.json" else os.path.basename(os.path.dirname(path))
    cfg, seed = name.rsplit("-s", 1)
    v = j.get("validation", {})
    rows.setdefault(cfg, {})[int(seed)] = (j["test_dice"], v.get("best_threshold"), v.get("val_dice_at_best"),
                                            v.get("test_dice_at_best"), j["train_seconds"], j["train_images_per_second"],
                                            j["model"]["pos_weight"], j["model"]["recon_weight"])
print("| loss | seed | test Dice at 0.5 | threshold chosen on validation | validation Dice at it | test Dice at it | train s (img/s) |")
print("|---|---:|---:|---:|---:|---:|---|")
for cfg, seeds in rows.items():
    for seed, (d05, t, vd, td, sec, ips, pw, rw) in sorted(seeds.items()):
        print(f"| {cfg} (w = {pw:.3f}, recon {rw:g}) | {seed} | {d05:.4f} | {t:.2f} | {vd:.4f} | {td:.4f} | {sec:.0f} ({ips:.0f}) |")
print()
print("| loss | seeds | test Dice at 0.5: mean (min–max) | test Dice at the validation threshold: mean (min–max) |")
print("|---|---|---:|---:|")
for cfg, seeds in rows.items():
    cells = []
    for k in (0, 3):
        vals = [s[k] for s in seeds.values()]
        cells.append(f"{sum(vals) / len(vals):.4f} ({min(vals):.4f}–{max(vals):.4f})" if len(vals) > 1 else f"{vals[0]:.4f}")
    print(f"| {cfg} | {', '.join(str(x) for x in sorted(seeds))} | " + " | ".join(cells) + " |")
