#!/bin/bash
# ST-CapsNet (the paper's CapsNet behind a 28x28-output transformer) toward <= 1.0% RTS test error at both
# seeds (issue 41), declared before any result (2026-11-30 15:25 UTC, for a later session): the 12-epoch
# protocol of docs/runs/stcaps28-rts (seeds 1 / 2: 0.85 / 1.33%, best validation at epoch 12 in both) stretched
# to 24 epochs, the per-epoch decay slowed from 0.8 to 0.88 (0.88^23 = 0.053 of 1e-3 at the end; 0.8^11 = 0.086),
# as the ST-CNN's 40-epoch lane did (docs/runs/stn28-rts40). 5,000 validation digits choose the epoch; the test
# set (10,000 digits, seed 2015) is scored there once. Seeds 1 and 2 in parallel, one thread each
# (≈ 4-6 min per epoch on one core of a 2-core AMD EPYC Zen 5: 1.6-2.5 h). Resumes exactly; a finished seed
# is skipped.   Usage: runs/stcaps24-lane.sh SEED NICE
cd /work/main
s=$1; n=${2:-5}; out=runs/stcaps28-rts24-s$s
[ -f $out/done ] && exit 0
args=(stn --model capsnet --stn on --stn-size 28 --epochs 24 --lr 1e-3 --lr-decay 0.88 --batch-size 64
      --val 5000 --test-limit 0 --seed $s --threads 1 --precision bf16 --checkpoint-every 500 --no-progress --out $out)
[ -f $out/capsnet+stn/checkpoint.pt ] && args+=(--resume)
nice -n $n build/bin/capsnet "${args[@]}" >> runs/stcaps28-rts24-s$s.log 2>&1 && touch $out/done
