#!/bin/bash
# ST-CapsNet (the paper's CapsNet, full width, behind a transformer with a 28x28 output) at the 12-epoch RTS
# protocol of runs/stn28-rts-s*, one thread.   Usage: runs/stcaps-lane.sh SEED NICE  (resumes exactly)
cd /work/main
s=$1; n=${2:-5}; out=runs/stcaps28-rts-s$s
args=(stn --model capsnet --stn on --stn-size 28 --epochs 12 --lr 1e-3 --lr-decay 0.8 --batch-size 64
      --val 5000 --test-limit 0 --seed $s --threads 1 --precision bf16 --checkpoint-every 500 --no-progress --out $out)
if [ -f $out/capsnet+stn/checkpoint.pt ]; then args+=(--resume); fi
exec nice -n $n build/bin/capsnet "${args[@]}" >> runs/stcaps28-rts-s$s.log 2>&1
