#!/usr/bin/env bash
# Quick start 1: set up, train a CapsNet on MNIST (1 epoch by default) and print the test accuracy.
#   scripts/run.sh [extra `capsnet train` flags, e.g. --epochs 3]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
build/bin/capsnet train --data data/mnist --out runs/mnist --epochs 1 "$@"
