#!/bin/bash
# Copies the reconstruction-weight MNIST runs' logs and per-epoch metrics into docs/runs/mnist-rs01.
cd /work/main
d=docs/runs/mnist-rs01; mkdir -p $d
for s in 1 2; do
  [ -f runs/mnist-rs01-s$s.log ] && cp runs/mnist-rs01-s$s.log $d/s$s.log
  [ -f runs/mnist-rs01-s$s/metrics.jsonl ] && cp runs/mnist-rs01-s$s/metrics.jsonl $d/s$s.metrics.jsonl
done
cp runs/rs01-lane.sh runs/rs01-sync.sh $d/
exit 0
