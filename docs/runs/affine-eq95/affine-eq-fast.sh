#!/bin/bash
# The CapsNet and pooled CNN at the unpooled CNN's 95% point, seeds 1 and 2, one after the other.
cd /work/main
runs/affine-eq-lane.sh 5 1 cnn capsnet
runs/affine-eq-lane.sh 5 2 cnn capsnet
