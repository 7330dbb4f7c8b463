#!/bin/bash
# One MNIST lane: the 40-epoch one-cycle recipe of runs/mnist-val40-s*, with the reconstruction weight the
# authors' code trains (0.01 beside a margin loss summed over classes), one thread.
# Usage: runs/rs01-lane.sh SEED NICE   (resumes exactly when runs/mnist-rs01-sSEED/checkpoint.pt exists)
cd /work/main
s=$1; n=${2:-5}; out=runs/mnist-rs01-s$s
args=(train --schedule fast --epochs 40 --val 5000 --precision bf16 --seed $s --threads 1
      --recon-weight 0.01 --out $out --checkpoint-every 550 --no-progress)
if [ -f $out/checkpoint.pt ]; then args+=(--resume $out/checkpoint.pt); fi
exec nice -n $n build/bin/capsnet "${args[@]}" >> runs/mnist-rs01-s$s.log 2>&1
