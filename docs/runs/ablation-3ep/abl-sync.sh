#!/bin/bash
# Copies the routing-ablation runs' logs and metrics into docs/runs/ablation-3ep.
cd /work/main
for log in runs/abl-*.log; do
  name=$(basename $log .log); name=${name#abl-}
  cp $log docs/runs/ablation-3ep/$name.log
  [ -f runs/abl-$name/metrics.jsonl ] && cp runs/abl-$name/metrics.jsonl docs/runs/ablation-3ep/$name.metrics.jsonl
done
cp runs/ablation-lane.sh runs/abl-sync.sh docs/runs/ablation-3ep/
exit 0
