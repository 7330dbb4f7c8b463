#!/bin/bash
# Stop 60's lanes: lane A = ST-CapsNet seed 1 (running) then seed 2, then ablation cells;
# lane B = MNIST rs01 seed 2 (running), then ablation cells.
cd /work/main
lane=$1
if [ "$lane" = A ]; then
  while pgrep -f 'stcaps28-rts-s1' > /dev/null; do sleep 20; done
  runs/stcaps-lane.sh 2 5
  runs/abl40-lane.sh 5 r1-norecon-s1 r1-recon-s2 r3-norecon-s2
else
  while pgrep -f 'mnist-rs01-s2' > /dev/null; do sleep 20; done
  runs/abl40-lane.sh 5 r1-recon-s1 r3-norecon-s1 r1-norecon-s2
fi
