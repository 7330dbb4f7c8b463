#!/bin/bash
# CapsPix2pix vs pix2pix (and the matched-parameter pix2pix), trained until the validation L1 stops improving.
cd /work/main
for cfg in "cnn-s2|--generator cnn --seed 2" "cnn9-s1|--generator cnn --cnn-channels 9 --seed 1" "cnn-s3|--generator cnn --seed 3" "cnn9-s2|--generator cnn --cnn-channels 9 --seed 2"; do
  name=${cfg%%|*}; flags=${cfg#*|}; out=runs/p2p-val-$name
  [ -f $out/capspix2pix.json ] && continue
  resume=""; [ -f $out/checkpoint.pt ] && resume="--resume $out/checkpoint.pt"
  nice -n 5 build/bin/capsnet capspix2pix $flags --val 1000 --eval-every 500 --patience 5000 --steps 40000 --batch-size 16 \
    --test-size 500 --checkpoint-every 500 --log-every 100 --no-progress --threads 1 --out $out $resume >> runs/p2p-val-$name.log 2>&1
done
