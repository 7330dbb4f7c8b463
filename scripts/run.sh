#!/usr/bin/env bash
# Quick start 1: set up, train a CapsNet on MNIST (1 epoch by default), print the test accuracy and
# write the (label, prediction, reconstruction) figure.
#   scripts/run.sh [extra `capsnet train` flags, e.g. --epochs 3]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
build/bin/capsnet train --data data/mnist --out runs/mnist --epochs 1 "$@"
build/bin/capsnet reconstruct --checkpoint runs/mnist/checkpoint.pt --data data/mnist \
  --out runs/mnist/reconstructions.png | tail -n 1
