#!/bin/bash
# Long training runs on a lent GPU machine (docs/gpu.md, "Training on a lent GPU"): builds libcapsnet_ops.so
# for the GPU (scripts/device_check.sh's build stage), then trains one CapsNet per RUNS entry with
# apps/gpu/train.py, all at once on the one GPU (each process is too small to fill it), every run planned by
# its own time probe to end within TRAIN_MINUTES. What comes back ($OUT; the device tool returns at most 8
# files of 16 MiB): summary.txt, logs.tar.gz (every run's log and metrics.jsonl, the build log, env.txt) and,
# per dataset, best.pt of the run with the best validation accuracy (ties: the lower validation loss) as
# <dataset>-best.pt. Rewrite those for Debian's PyTorch with `/usr/bin/python3 apps/gpu/train.py --resave`.
#
# Usage (on the device; the data as gzipped IDX files carried in data/device/<dataset>/, see
# scripts/device_data.sh):
#   RUNS="mnist:1 mnist:2 fashion-mnist:1 fashion-mnist:2" TRAIN_MINUTES=7 \
#   TRAIN_ARGS="--schedule fast --lr 3e-3 --epochs 150 --val 5000" scripts/device_train.sh
# TRAIN_ARGS_<dataset> (dashes as underscores, e.g. TRAIN_ARGS_fashion_mnist) overrides TRAIN_ARGS for one dataset.
# RUNS entries affine-cnn-nopool:SEED / affine-cnn:SEED train the affine experiment's unpooled / pooled baseline
# CNN with apps/gpu/affine_cnn.py instead (data/device/mnist and data/device/affine-sets; its results.json
# holds every set's accuracy; TRAIN_ARGS_affine_cnn_nopool adds flags). RUNS entries multimnist:SEED train the
# MultiMNIST CapsNet with apps/gpu/multimnist.py (data/device/mnist; TRAIN_ARGS_multimnist adds flags, e.g.
# "--steps 400000 --final-lr 0.05 --eval-every 20000"); the first such seed's last model comes back in parts
# (multimnist-sN-model.partK.pt: join them with `apps/gpu/multimnist.py --join`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/device}
mkdir -p "$OUT"
RUNS=${RUNS:-mnist:1 mnist:2}
TRAIN_MINUTES=${TRAIN_MINUTES:-7}
TRAIN_ARGS=${TRAIN_ARGS:---schedule fast --lr 3e-3 --epochs 150 --val 5000}
PY=${PYTHON:-python3}
work=$(mktemp -d)
start=$(date +%s)
say() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$OUT/summary.txt"; }
say "device_train: RUNS='$RUNS' TRAIN_MINUTES=$TRAIN_MINUTES TRAIN_ARGS='$TRAIN_ARGS'"

# The ops library: device_check.sh's build stage (its build.log and env.txt go into the logs), unless
# OPS_LIBRARY names one (a dry run on a CPU: OPS_LIBRARY=build/capsnet/ops/libcapsnet_ops.so, TRAIN_ARGS with
# --device cpu and small --train-limit / --test-limit).
if [ -n "${OPS_LIBRARY:-}" ]; then
  lib=$OPS_LIBRARY
else
  STAGES=build OUT="$work" scripts/device_check.sh > /dev/null 2>&1
  lib=$(ls -t build-cuda*/capsnet/ops/libcapsnet_ops.so build-cuda-ext/capsnet_ops.so 2>/dev/null | head -1)
fi
say "ops library: ${lib:-none}; $(grep -m1 '^torch' "$work/env.txt" 2>/dev/null)"
[ -n "$lib" ] || { say "no ops library: see build.log"; tar -C "$work" -czf "$OUT/logs.tar.gz" .; exit 1; }

pids=()
for run in $RUNS; do
  dataset=${run%%:*} seed=${run##*:}
  dir=$work/$dataset-s$seed
  own=TRAIN_ARGS_${dataset//-/_}  # e.g. TRAIN_ARGS_fashion_mnist: that dataset's own arguments
  case $dataset in
    affine-cnn-nopool|affine-cnn)  # the affine experiment's baseline CNN (apps/gpu/affine_cnn.py), no time plan
      [ -d data/device/affine-sets ] || { say "$run: no data/device/affine-sets (carry it)"; continue; }
      pool=(); [ "$dataset" = affine-cnn ] && pool=(--pool)
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 $PY apps/gpu/affine_cnn.py --data data/device/mnist --sets data/device/affine-sets \
        --seed "$seed" --out "$dir" "${pool[@]}" ${!own:-} > "$work/$dataset-s$seed.log" 2>&1 & ;;
    multimnist)  # the MultiMNIST CapsNet (apps/gpu/multimnist.py): the C++ tool's pairs, planned to TRAIN_MINUTES
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 $PY apps/gpu/multimnist.py --data data/device/mnist --seed "$seed" --out "$dir" \
        --ops-library "$lib" --minutes "$TRAIN_MINUTES" ${TRAIN_ARGS_multimnist:-} > "$work/$dataset-s$seed.log" 2>&1 & ;;
    *)
      data=data/device/$dataset
      [ -d "$data" ] || { say "$run: no $data (carry data/device/$dataset)"; continue; }
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 $PY apps/gpu/train.py --data "$data" --dataset "$dataset" --seed "$seed" --out "$dir" \
        --ops-library "$lib" --minutes "$TRAIN_MINUTES" ${!own:-$TRAIN_ARGS} > "$work/$dataset-s$seed.log" 2>&1 & ;;
  esac
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
say "training done"

for run in $RUNS; do
  dataset=${run%%:*} seed=${run##*:}
  say "$dataset seed $seed: $(grep -E '^(time probe|best validation|trained|scored|  affnist-style)' "$work/$dataset-s$seed.log" | tr '\n' ' ')"
  cp "$work/$dataset-s$seed/results.json" "$work/$dataset-s$seed.results.json" 2>/dev/null
  tail -3 "$work/$dataset-s$seed.log" | grep -i -E 'error|Traceback' >> "$OUT/summary.txt"
  cp "$work/$dataset-s$seed/metrics.jsonl" "$work/$dataset-s$seed.metrics.jsonl" 2>/dev/null
done
# Per dataset, the run with the best validation (the rule of docs/runs/epochs.py) ships its best.pt.
$PY - "$work" "$OUT" $RUNS <<'EOF' | tee -a "$OUT/summary.txt"
import json, os, shutil, sys
work, out, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
best = {}
for run in runs:
    dataset, seed = run.split(":")
    path = os.path.join(work, f"{dataset}-s{seed}", "metrics.jsonl")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(work, f"{dataset}-s{seed}", "best.pt")):
        continue
    recs = [json.loads(l) for l in open(path) if l.strip()]
    val = [r for r in recs if r.get("event") == "eval" and r["split"] == "val"]
    test = {round(r["epoch"]): r["accuracy"] for r in recs if r.get("event") == "eval" and r["split"] == "test"}
    if not val:
        continue
    b = max(val, key=lambda r: (r["accuracy"], -r["loss"]))
    key = (b["accuracy"], -b["loss"])
    print(f"{dataset} seed {seed}: best validation {100 * b['accuracy']:.2f}% at epoch {round(b['epoch'])} of "
          f"{len(val)}, its test {100 * test.get(round(b['epoch']), float('nan')):.2f}%, last epoch's test "
          f"{100 * test[max(test)]:.2f}%")
    if dataset not in best or key > best[dataset][0]:
        best[dataset] = (key, seed)
for dataset, (_, seed) in best.items():
    shutil.copy(os.path.join(work, f"{dataset}-s{seed}", "best.pt"), os.path.join(out, f"{dataset}-best.pt"))
    print(f"{dataset}: ships seed {seed}'s best.pt as {dataset}-best.pt")
# MultiMNIST has no validation split: the first seed's last model comes back, in its parts (16 MiB each at most).
for run in runs:
    dataset, seed = run.split(":")
    folder = os.path.join(work, f"{dataset}-s{seed}")
    if dataset != "multimnist" or not os.path.isdir(folder):
        continue
    parts = sorted(p for p in os.listdir(folder) if p.startswith("model") and p.endswith(".pt"))
    for p in parts:
        shutil.copy(os.path.join(folder, p), os.path.join(out, f"multimnist-s{seed}-{p}"))
    print(f"multimnist: returns seed {seed}'s last model as {', '.join(f'multimnist-s{seed}-{p}' for p in parts)}")
    break
EOF
tar -C "$work" -czf "$OUT/logs.tar.gz" --exclude='*.pt' --exclude='metrics.jsonl' .
say "done; $OUT: $(ls "$OUT" | tr '\n' ' ')"
