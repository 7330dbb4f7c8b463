#!/bin/bash
# Copies the affine runs' logs and metrics into docs/runs (committed as they go).
cd /work/main
for r in affine-s1-capsnet affine-s2-cnn affine-s2-capsnet affine-s1-cnn-nopool-lr1e-3 affine-s1-cnn-nopool affine-eq95-s{1,2}-{capsnet,cnn,cnn-nopool}; do
  [ -d runs/$r ] || continue
  mkdir -p docs/runs/$r
  cp runs/$r.log docs/runs/$r.log
  [ -f runs/$r/metrics.jsonl ] && cp runs/$r/metrics.jsonl docs/runs/$r/metrics.jsonl
  for m in capsnet cnn; do [ -f runs/$r/$m/metrics.jsonl ] && cp runs/$r/$m/metrics.jsonl docs/runs/$r/$m.metrics.jsonl; done
  for f in affine.json robustness.md; do [ -f runs/$r/$f ] && cp runs/$r/$f docs/runs/$r/$f; done
done
