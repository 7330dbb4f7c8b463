#!/bin/bash
# A labelled ensemble row for issue 42 (never the headline), declared before it was scored (2026-11-30):
# every 40-epoch MNIST run with the 5,000-image validation split whose best.pt was still in runs/ — the
# routing ablation's r1/recon, r1/no-recon, r3/no-recon cells and the recon-weight-0.01 runs, two seeds each
# (8 CapsNets of the paper's architecture, each checkpoint chosen by its own validation). No member is chosen
# or weighted by any score: the ensemble averages their capsule lengths. Scored on the validation split
# (the last 5,000 training images, held out by all eight) and on the test set; fp32, one thread.
# Usage: docs/runs/mnist-ensemble/ensemble.sh NICE   (writes docs/runs/mnist-ensemble/{val,test}.{json,txt})
cd /work/main
n=${1:-5}
members=()
for r in abl40-r1-recon abl40-r1-norecon abl40-r3-norecon mnist-rs01; do
  for s in 1 2; do members+=(--checkpoint runs/$r-s$s/best.pt); done
done
out=docs/runs/mnist-ensemble
for split in val test; do
  which=(--split test); [ $split = val ] && which=(--val 5000)
  nice -n $n build/bin/capsnet eval "${members[@]}" "${which[@]}" --threads 1 --json > $out/$split.json
  nice -n $n build/bin/capsnet eval "${members[@]}" "${which[@]}" --threads 1 --no-progress > $out/$split.txt
done
