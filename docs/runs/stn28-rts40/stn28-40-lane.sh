#!/bin/bash
# ST-CNN (28x28 transformer output, --small) toward the issue's <= 1.0% RTS test error, declared before any
# result (2026-11-30 14:24 UTC): the 12-epoch protocol of docs/runs/stn28-rts-s1 (both seeds had their best
# validation at epoch 11 or 12: not converged) stretched to 40 epochs, the learning rate's per-epoch decay
# slowed from 0.8 to 0.93 so that it ends at a similar fraction of 1e-3 (0.93^39 = 0.059; 0.8^11 = 0.086).
# 5,000 validation digits choose the epoch (best.pt), the test set (10,000 digits, seed 2015) is scored there
# once. Seeds 1 and 2, one after the other on one thread; both are reported as mean and spread.
# Resumes exactly from its checkpoint; a finished seed is skipped.
# Usage: runs/stn28-40-lane.sh NICE SEED...
cd /work/main
n=$1; shift
for s in "$@"; do
  out=runs/stn28-rts40-s$s
  [ -f $out/done ] && continue
  args=(stn --model cnn --stn on --stn-size 28 --small --epochs 40 --lr 1e-3 --lr-decay 0.93 --batch-size 64
        --val 5000 --test-limit 0 --seed $s --threads 1 --precision bf16 --checkpoint-every 500 --no-progress --out $out)
  [ -f $out/cnn+stn/checkpoint.pt ] && args+=(--resume)
  nice -n $n build/bin/capsnet "${args[@]}" >> runs/stn28-rts40-s$s.log 2>&1 && touch $out/done
done
