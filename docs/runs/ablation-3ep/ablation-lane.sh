#!/bin/bash
# Routing ablation at a budget: r x reconstruction, each a 3-epoch one-cycle run with 5,000 validation images
# choosing the epoch (best.pt); test accuracy at that epoch. Usage: ablation-lane.sh NAME... (r3-recon-s1, r1-norecon-s2)
cd /work/main
for name in "$@"; do
  r=${name%%-*}; r=${r#r}; rest=${name#*-}; recon=${rest%-s*}; seed=${name##*-s}
  flags=""; [ "$recon" = norecon ] && flags="--no-reconstruction"
  out=runs/abl-$name
  [ -f $out/done ] && continue
  resume=""; [ -f $out/checkpoint.pt ] && resume="--resume $out/checkpoint.pt"
  nice -n 10 build/bin/capsnet train --routing-iters $r $flags --schedule fast --epochs 3 --val 5000 --seed $seed \
    --precision bf16 --threads 1 --no-progress --checkpoint-every 500 --out $out $resume >> runs/abl-$name.log 2>&1 \
    && touch $out/done
done
