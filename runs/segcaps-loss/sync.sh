#!/bin/bash
# Copies the SegCaps loss runs' logs, metrics and summaries into docs/runs/segcaps-loss (committed as they go).
cd /work/main
d=docs/runs/segcaps-loss; mkdir -p $d
cp runs/segcaps-loss/all.log runs/segcaps-loss/run_all.sh runs/segcaps-loss/table.py $d/
for r in runs/segcaps-loss/*/; do
  n=$(basename $r)
  [ -f $r/metrics.jsonl ] && cp $r/metrics.jsonl $d/$n.metrics.jsonl
  [ -f $r/segcaps.json ] && cp $r/segcaps.json $d/$n.segcaps.json
done
exit 0
