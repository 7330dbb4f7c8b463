#!/bin/bash
# One MNIST lane (issue 42), declared before any result (2026-11-30 21:50 UTC): the 40-epoch one-cycle recipe of
# runs/mnist-val40-s* (docs/results.md, "MNIST with a validation split": 99.56 / 99.60% by the rule) with the one
# change --init authors (the authors' code's initialisation: truncated normals, biases 0.1, PrimaryCaps'
# convolution divided by its 32 types). Under Adam the step is ~lr whatever the weights' size, so weights ten to
# twenty-five times larger than LibTorch's defaults (PrimaryCaps, DigitCaps W) train at a correspondingly smaller
# relative rate: the one way our optimisation still differs from theirs in kind, besides DigitCaps' bias.
# The validation split (last 5,000 training images) chooses the epoch (best.pt); the test set is scored beside it.
# Seeds 1 and 2 in parallel, one thread each. Across sessions by exact resume.
# Usage: runs/authors-lane.sh SEED NICE
cd /work/main
s=$1; n=${2:-5}; out=runs/mnist-authors-s$s
[ -f $out/done ] && exit 0
args=(train --schedule fast --epochs 40 --val 5000 --precision bf16 --seed $s --threads 1
      --init authors --out $out --checkpoint-every 550 --no-progress)
if [ -f $out/checkpoint.pt ]; then args+=(--resume $out/checkpoint.pt); fi
nice -n $n build/bin/capsnet "${args[@]}" >> runs/mnist-authors-s$s.log 2>&1 && touch $out/done
