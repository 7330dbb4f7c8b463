#!/bin/bash
# The plain CNN (42x42 input) at the 12-epoch RTS protocol of runs/stn-rts-s1, one thread; waits for the
# ST-CNN lane of the same seed to finish first.   Usage: runs/cnn-rts-lane.sh SEED NICE
cd /work/main
s=$1; n=${2:-5}; out=runs/cnn-rts-s$s
while pgrep -f "stn28-rts-s$s" > /dev/null; do sleep 20; done
args=(stn --model cnn --stn off --small --epochs 12 --lr 1e-3 --lr-decay 0.8 --batch-size 64
      --val 5000 --test-limit 0 --seed $s --threads 1 --precision bf16 --checkpoint-every 500 --no-progress --out $out)
if [ -f $out/cnn/checkpoint.pt ]; then args+=(--resume); fi
exec nice -n $n build/bin/capsnet "${args[@]}" >> runs/cnn-rts-s$s.log 2>&1
