#!/bin/bash
# The plain CNN (--small, 42x42 input, no transformer) at the ST-CNN's 40-epoch budget, so that the transformer's
# gain is measured at equal training (issue 41), declared before any result (2026-11-30 19:30 UTC, for a later
# session): exactly the ST-CNN's 40-epoch protocol of docs/runs/stn28-rts40 (epochs 40, lr 1e-3 x 0.93 per epoch,
# batch 64, bf16) with --stn off. 5,000 validation digits choose the epoch (best.pt); the test set (10,000
# digits, seed 2015) is scored there once. Seeds 1 and 2 in parallel, one thread each (the 12-epoch CNN ran at
# 130-150 img/s on a shared thread: about 2-3 h per seed). Resumes exactly; a finished seed is skipped.
# Usage: runs/cnn40-lane.sh SEED NICE
cd /work/main
s=$1; n=${2:-5}; out=runs/cnn-rts40-s$s
[ -f $out/done ] && exit 0
args=(stn --model cnn --stn off --small --epochs 40 --lr 1e-3 --lr-decay 0.93 --batch-size 64
      --val 5000 --test-limit 0 --seed $s --threads 1 --precision bf16 --checkpoint-every 500 --no-progress --out $out)
[ -f $out/cnn/checkpoint.pt ] && args+=(--resume)
nice -n $n build/bin/capsnet "${args[@]}" >> runs/cnn-rts40-s$s.log 2>&1 && touch $out/done
