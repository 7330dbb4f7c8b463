#!/bin/bash
# Copies the capspix2pix validation runs' logs, metrics and results into docs/runs/capspix2pix-val.
cd /work/main
d=docs/runs/capspix2pix-val
for log in runs/p2p-val-*.log; do
  name=$(basename $log .log); name=${name#p2p-val-}; r=runs/p2p-val-$name
  cp $log $d/$name.log
  [ -f $r/metrics.jsonl ] && cp $r/metrics.jsonl $d/$name.metrics.jsonl
  [ -f $r/capspix2pix.json ] && cp $r/capspix2pix.json $d/$name.json
done
cp runs/p2p-lane.sh runs/p2p-sync.sh $d/
exit 0
