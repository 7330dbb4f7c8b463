#!/bin/bash
# ST-CNN with a 28x28 transformer output at the 12-epoch protocol of runs/stn-rts-s1, one thread.
# Usage: runs/stn28-lane.sh SEED NICE   (resumes exactly when the run folder has a checkpoint)
cd /work/main
s=$1; n=${2:-5}; out=runs/stn28-rts-s$s
args=(stn --model cnn --stn on --stn-size 28 --small --epochs 12 --lr 1e-3 --lr-decay 0.8 --batch-size 64
      --val 5000 --test-limit 0 --seed $s --threads 1 --precision bf16 --checkpoint-every 500 --no-progress --out $out)
if [ -f $out/cnn+stn/checkpoint.pt ]; then args+=(--resume); fi
exec nice -n $n build/bin/capsnet "${args[@]}" >> runs/stn28-rts-s$s.log 2>&1
