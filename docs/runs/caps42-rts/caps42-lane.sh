#!/bin/bash
# The CapsNet without a transformer on the 42x42 RTS canvas (issue 41), declared before any result
# (2026-12-01 05:12 UTC): the 12-epoch RTS protocol that CNN, ST-CNN and ST-CapsNet ran at seeds 1 and 2
# (docs/runs/stcaps28-rts/stcaps-lane.sh with --stn off: lr 1e-3 x0.8 per epoch, batch 64, bf16), so that the
# four models stand at equal training. 5,000 validation digits choose the epoch (best.pt); the test set
# (10,000 digits, seed 2015) is scored there once. Seeds 1 and 2 in parallel, one thread each (a 60-step
# probe: 87 img/s on one core of a 2-core AMD EPYC Zen 5, so ~2 h per seed). Resumes exactly; a finished
# seed is skipped.   Usage: runs/caps42-lane.sh SEED NICE
cd /work/main
s=$1; n=${2:-5}; out=runs/caps42-rts-s$s
[ -f $out/done ] && exit 0
args=(stn --model capsnet --stn off --epochs 12 --lr 1e-3 --lr-decay 0.8 --batch-size 64
      --val 5000 --test-limit 0 --seed $s --threads 1 --precision bf16 --checkpoint-every 500 --no-progress --out $out)
[ -f $out/capsnet/checkpoint.pt ] && args+=(--resume)
nice -n $n build/bin/capsnet "${args[@]}" >> runs/caps42-rts-s$s.log 2>&1 && touch $out/done
