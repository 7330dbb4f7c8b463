#!/usr/bin/env python3
"""Markdown table of the capspix2pix runs trained to validation: DIR/p2p-val-NAME/capspix2pix.json or the
copies DIR/NAME.capspix2pix.json.   Usage: table.py [DIR] (default: this file's folder)"""
import glob, json, os, sys
here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
paths = glob.glob(os.path.join(here, "p2p-val-*", "capspix2pix.json")) + glob.glob(os.path.join(here, "*.capspix2pix.json"))
rows = []
for path in paths:
    j = json.load(open(path))
    name = os.path.basename(os.path.dirname(path))[len("p2p-val-"):] if path.endswith("/capspix2pix.json") \
        else os.path.basename(path)[: -len(".capspix2pix.json")]
    v, t = j.get("validation", {}), j["test"]
    rows.append((name, j["generator_parameters"], j["train_seed"], j["steps"], v.get("best_step"), v.get("best_l1"),
                 t["l1"], t["psnr_db"], t["ssim"], t["diversity"], j["train_images_per_second"]))
print("| run | G parameters | seed | steps (stopped) | best step | validation L1 | test L1 | PSNR dB | SSIM | diversity | img/s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in sorted(rows):
    print(f"| {r[0]} | {r[1]:,} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.4f} | {r[6]:.4f} | {r[7]:.2f} | {r[8]:.3f} | {r[9]:.4f} | {r[10]:.0f} |")
