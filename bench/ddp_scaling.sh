#!/bin/bash
# Data-parallel scaling on one machine: 1 process x 1 thread, 2 processes x 1 thread (--nproc 2),
# 1 process x 2 threads; 3 interleaved repeats; prints each run's throughput line.
#   bench/ddp_scaling.sh [OUT_DIR]     (default runs/ddp_scaling; run from the repository root)
set -euo pipefail
C=build/bin/capsnet
D=${1:-runs/ddp_scaling}
mkdir -p "$D"
A=(train --data data/mnist --train-limit 12800 --steps 20 --batch-size 64 --no-eval --no-progress --seed 1)
for r in 1 2 3; do
  $C "${A[@]}" --out "$D/p1t1_$r" --threads 1 > "$D/p1t1_$r.log" 2>&1
  $C "${A[@]}" --out "$D/p2t1_$r" --threads 2 --nproc 2 > "$D/p2t1_$r.log" 2>&1
  $C "${A[@]}" --out "$D/p1t2_$r" --threads 2 > "$D/p1t2_$r.log" 2>&1
done
grep -H "trained steps" "$D"/*.log
