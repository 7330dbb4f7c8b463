#!/bin/bash
# Copies the 40-epoch routing-ablation runs' logs and metrics into docs/runs/ablation-40ep (NAME.log,
# NAME.metrics.jsonl; the r3-recon cells are the runs/mnist-val40-s* runs of the same recipe).
# Table: python3 docs/runs/ablation-3ep/table.py docs/runs/ablation-40ep
cd /work/main
d=docs/runs/ablation-40ep; mkdir -p $d
for f in runs/abl40-*.log; do
  [ -f "$f" ] || continue
  name=$(basename $f .log); name=${name#abl40-}
  cp $f $d/$name.log
  [ -f runs/abl40-$name/metrics.jsonl ] && cp runs/abl40-$name/metrics.jsonl $d/$name.metrics.jsonl
done
for s in 1 2; do
  cp docs/runs/mnist-val40-s$s.log $d/r3-recon-s$s.log
  cp docs/runs/mnist-val40-s$s.metrics.jsonl $d/r3-recon-s$s.metrics.jsonl
done
cp runs/abl40-lane.sh runs/abl40-sync.sh $d/
exit 0
