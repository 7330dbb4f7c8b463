#!/bin/bash
# MNIST toward 99.70% (issue 42): the 40-epoch one-cycle recipe of runs/mnist-val40-s* stretched to 120 epochs,
# with the weights' exponential moving average (--ema-decay 0.9995, half-life ~1,400 steps = 2.5 epochs) as
# the evaluated, validation-chosen and shipped model. Pre-declared before any result: the shipped checkpoint is
# best.pt (the average's best validation accuracy over the 120 epochs, ties the lower validation loss).
# One thread; resumes exactly from its checkpoint; a finished run is skipped.
# Usage: runs/mnist-ema-lane.sh NICE SEED...
cd /work/main
n=$1; shift
for seed in "$@"; do
  out=runs/mnist-ema120-s$seed
  [ -f $out/done ] && continue
  resume=(); [ -f $out/checkpoint.pt ] && resume=(--resume $out/checkpoint.pt)
  nice -n $n build/bin/capsnet train --schedule fast --epochs 120 --val 5000 --ema-decay 0.9995 --seed $seed \
    --precision bf16 --threads 1 --no-progress --checkpoint-every 550 --out $out "${resume[@]}" \
    >> runs/mnist-ema120-s$seed.log 2>&1 && touch $out/done
done
