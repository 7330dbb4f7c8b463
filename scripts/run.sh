#!/usr/bin/env bash
# Quick start 1: set up, train a CapsNet on MNIST (1 epoch by default), print the test accuracy and
# write the (label, prediction, reconstruction) figure.
#   scripts/run.sh [extra `capsnet train` flags, e.g. --epochs 3]
# The quick start's own folder, runs/quickstart, is replaced on every run (--overwrite); your runs
# elsewhere are never overwritten without being asked.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
build/bin/capsnet train --data data/mnist --out runs/quickstart --overwrite --epochs 1 "$@"
build/bin/capsnet reconstruct --checkpoint runs/quickstart/checkpoint.pt --data data/mnist \
  --out runs/quickstart/reconstructions.png | tail -n 1
