#!/bin/bash
# Copies the ST-CapsNet RTS runs into docs/runs/stcaps28-rts-sN (log, stn.json, stn.md, metrics) and their
# figures into docs/figures/stcaps28_rts_sN_transforms.png.
cd /work/main
for s in 1 2; do
  src=runs/stcaps28-rts-s$s; d=docs/runs/stcaps28-rts-s$s
  [ -d $src ] || continue
  mkdir -p $d/capsnet+stn
  [ -f runs/stcaps28-rts-s$s.log ] && cp runs/stcaps28-rts-s$s.log docs/runs/stcaps28-rts-s$s.log
  for f in stn.json stn.md metrics.jsonl; do [ -f $src/$f ] && cp $src/$f $d/; done
  [ -f $src/capsnet+stn/metrics.jsonl ] && cp $src/capsnet+stn/metrics.jsonl $d/capsnet+stn/
  [ -f $src/stn_transforms.png ] && cp $src/stn_transforms.png docs/figures/stcaps28_rts_s${s}_transforms.png
done
cp runs/stcaps-lane.sh runs/stcaps-sync.sh runs/chain-session60.sh docs/runs/stcaps28-rts/
exit 0
