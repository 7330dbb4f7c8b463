#!/bin/bash
# Copies the Fashion-MNIST 40-epoch runs' logs and per-epoch metrics into docs/runs/fashion-ema40 (sN.log, sN.metrics.jsonl).
cd /work/main && scripts/sync_run_logs.sh docs/runs/fashion-ema40 runs/fashion-ema40- runs/fashion40-lane.sh runs/fashion40-sync.sh
