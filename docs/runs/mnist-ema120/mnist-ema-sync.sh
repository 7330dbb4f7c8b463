#!/bin/bash
# Copies the MNIST EMA runs' logs and per-epoch metrics into docs/runs/mnist-ema120 (sNAME.log,
# sNAME.metrics.jsonl) with the lane script, so that the run's progress is in the repository across sessions.
cd /work/main
d=docs/runs/mnist-ema120; mkdir -p $d
for s in 1 2; do
  [ -f runs/mnist-ema120-s$s.log ] && cp runs/mnist-ema120-s$s.log $d/s$s.log
  [ -f runs/mnist-ema120-s$s/metrics.jsonl ] && cp runs/mnist-ema120-s$s/metrics.jsonl $d/s$s.metrics.jsonl
done
cp runs/mnist-ema-lane.sh runs/mnist-ema-sync.sh $d/
exit 0
