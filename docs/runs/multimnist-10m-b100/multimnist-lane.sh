#!/bin/bash
# MultiMNIST toward <= 10% test error (issue 42), pre-declared before any result: the paper's model (bf16),
# 10 million generated pairs (100,000 steps of 100) with the learning rate 1e-3 x0.99 per 60,000 pairs (0.19 of
# 1e-3 at the end), the 10,000 fixed test pairs scored every 500,000 pairs; the model reported and shipped is the
# last one (no choice is made). It replaces the batch-50 lane of docs/runs/multimnist-10m/ (stopped at 555,000
# pairs, 20.18% at 500,000) because batch 100 trains 1.22-1.25x as many pairs per second on this machine
# (docs/runs/multimnist-10m/batch-probe.log); the authors' code trains with batches of 128.
# Two threads; resumes exactly from its checkpoint (every 500 steps = 50,000 pairs); spans sessions.
# Usage: runs/mm10m-lane.sh NICE [capsnet|cnn]
cd "$(dirname "$0")/.."  # the repository root wherever it is checked out (the script runs as runs/mm10m-lane.sh)
n=$1; model=${2:-capsnet}
out=runs/mm10m-b100-$model
[ -f $out/done ] && exit 0
resume=(--overwrite); [ -f $out/checkpoint.pt ] && resume=(--resume $out/checkpoint.pt)
nice -n $n build/bin/capsnet multimnist --model $model --steps 100000 --batch-size 100 --lr-decay 0.99 \
  --test-size 10000 --seed 1 --eval-every 5000 --checkpoint-every 500 --precision bf16 --threads 2 \
  --no-progress --out $out "${resume[@]}" >> runs/mm10m-b100-$model.log 2>&1 && touch $out/done
