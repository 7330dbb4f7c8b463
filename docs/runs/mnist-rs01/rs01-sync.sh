#!/bin/bash
# Copies the reconstruction-weight MNIST runs' logs and per-epoch metrics into docs/runs/mnist-rs01.
cd /work/main && scripts/sync_run_logs.sh docs/runs/mnist-rs01 runs/mnist-rs01- runs/rs01-lane.sh runs/rs01-sync.sh
