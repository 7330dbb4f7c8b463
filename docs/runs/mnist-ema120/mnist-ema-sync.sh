#!/bin/bash
# Copies the MNIST EMA runs' logs and per-epoch metrics into docs/runs/mnist-ema120 (sN.log, sN.metrics.jsonl).
cd /work/main && scripts/sync_run_logs.sh docs/runs/mnist-ema120 runs/mnist-ema120- runs/mnist-ema-lane.sh runs/mnist-ema-sync.sh
