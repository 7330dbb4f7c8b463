#!/bin/bash
# CapsPix2pix vs pix2pix vs matched pix2pix on equal images: at most 16,000 steps x 16 maps, validation L1 every
# 500 steps chooses best.pt, early stop when the best is 5,000 steps old. Usage: p2p-lane.sh NAME... (caps-s1, cnn-s2, cnn9-s3)
cd /work/main
for name in "$@"; do
  gen=${name%-s*}; seed=${name##*-s}; flags="--generator caps"
  [ "$gen" = cnn ] && flags="--generator cnn"
  [ "$gen" = cnn9 ] && flags="--generator cnn --cnn-channels 9"
  out=runs/p2p-val-$name
  [ -f $out/capspix2pix.json ] && continue
  resume=""; [ -f $out/checkpoint.pt ] && resume="--resume $out/checkpoint.pt"
  nice -n 5 build/bin/capsnet capspix2pix $flags --seed $seed --val 1000 --eval-every 500 --patience 5000 --steps 16000 \
    --batch-size 16 --test-size 500 --checkpoint-every 500 --log-every 100 --no-progress --threads 1 --precision bf16 \
    --classifier models/capsnet-fashion-mnist/capsnet-fashion-mnist.pt --out $out $resume >> runs/p2p-val-$name.log 2>&1
done
