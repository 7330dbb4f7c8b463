#!/bin/bash
# Routing ablation to convergence: r x reconstruction with the 40-epoch one-cycle recipe of runs/mnist-val40-s*
# (5,000 validation images choose the epoch: best.pt), one thread each. Runs the named cells one after another;
# a finished cell is skipped, a started one resumes exactly from its checkpoint.
# Usage: runs/abl40-lane.sh NICE NAME...   (NAME: r1-recon-s1, r3-norecon-s2, ...)
cd /work/main
n=$1; shift
for name in "$@"; do
  r=${name%%-*}; r=${r#r}; rest=${name#*-}; recon=${rest%-s*}; seed=${name##*-s}
  flags=(); [ "$recon" = norecon ] && flags=(--no-reconstruction)
  out=runs/abl40-$name
  [ -f $out/done ] && continue
  resume=(); [ -f $out/checkpoint.pt ] && resume=(--resume $out/checkpoint.pt)
  nice -n $n build/bin/capsnet train --routing-iters $r "${flags[@]}" --schedule fast --epochs 40 --val 5000 \
    --seed $seed --precision bf16 --threads 1 --no-progress --checkpoint-every 550 --out $out "${resume[@]}" \
    >> runs/abl40-$name.log 2>&1 && touch $out/done
done
