#!/bin/bash
# SegCaps with the authors' loss vs without the reconstruction term vs plain BCE, seeds 1 and 2.
# Each run: 5000 steps x 8 images, lr 2e-3, threshold chosen on 1000 validation images (held-out digits).
cd /work/main
for seed in 1 2; do
  for cfg in "authors|--pos-weight dataset --recon-weight 131.072" "authors-norecon|--pos-weight dataset --recon-weight 0" "plain|--pos-weight 1 --recon-weight 0"; do
    name=${cfg%%|*}; flags=${cfg#*|}
    out=runs/segcaps-loss/$name-s$seed
    [ -f $out/segcaps.json ] && continue
    resume=""; [ -f $out/checkpoint.pt ] && resume="--resume $out/checkpoint.pt"
    [ -z "$resume" ] && [ -d $out ] && resume="--overwrite"
    echo "=== $(date -u +%FT%TZ) $name seed $seed" >> runs/segcaps-loss/all.log
    nice -n 5 build/bin/capsnet segcaps --out $out --steps 5000 --batch-size 8 --lr 2e-3 --val 1000 --test-size 1000 \
      --seed $seed --log-every 100 --checkpoint-every 500 --no-progress --threads 1 $flags $resume >> runs/segcaps-loss/all.log 2>&1
  done
done
