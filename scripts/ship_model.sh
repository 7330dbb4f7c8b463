#!/usr/bin/env bash
# Turns a training checkpoint into the shipped model: fp16 weights + model card + SHA-256.
#   scripts/ship_model.sh CHECKPOINT OUT_DIR "COMMAND THAT TRAINED IT" [DATASET]
# Writes OUT_DIR/capsnet-<dataset>.pt (weights only, fp16 storage, an 8-image probe for ports, the
# card inside as JSON), OUT_DIR/card.json and OUT_DIR/SHA256SUMS. The card's accuracy is measured on
# the fp16 file itself, over the whole test split, so `capsnet eval` on it prints exactly that.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLI="${CAPSNET_CLI:-$ROOT/build/bin/capsnet}"  # CAPSNET_CLI: another build of the tool
CKPT="$1"; OUT="$2"; COMMAND="$3"; DATASET="${4:-mnist}"
NAME="capsnet-$DATASET.pt"
mkdir -p "$OUT"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT

"$CLI" export --checkpoint "$CKPT" --storage fp16 --probe 8 --out "$tmp/w.pt"
"$CLI" eval --checkpoint "$tmp/w.pt" --dataset "$DATASET" --json --no-progress > "$tmp/eval.json"
step=$(/usr/bin/python3 -c "import torch; print(torch.load('$tmp/w.pt')['step'])")
/usr/bin/python3 - "$tmp/eval.json" "$CKPT" "$step" "$DATASET" "$COMMAND" > "$tmp/card.json" <<'EOF'
import json, sys
ev = json.load(open(sys.argv[1]))
ckpt, step, dataset, command = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
meta_epochs = step / 600  # 60,000 training images at batch 100
wrong = ev["examples"] - sum(ev["confusion"][k][k] for k in range(len(ev["confusion"])))
print(json.dumps({
    "model": "CapsNet (Sabour et al. 2017): Conv1 256@9x9, PrimaryCaps 32x8D, DigitCaps 10x16D, r=3, decoder",
    "dataset": dataset,
    "command": command,
    "steps": step,
    "epochs": round(meta_epochs, 3),
    "precision": "trained with fp32 master weights (see docs/results.md for the compute precision per epoch); stored fp16",
    "storage": "fp16",
    "test_accuracy": ev["accuracy"],
    "test_errors": wrong,
    "test_examples": ev["examples"],
    "evaluated_with": "capsnet eval on this file (fp32 compute), whole test split",
}, indent=2))
EOF
"$CLI" export --checkpoint "$tmp/w.pt" --storage fp16 --probe 8 --card "$tmp/card.json" --out "$OUT/$NAME"
# The card as stored in the file (export adds the class names, image fit and dataset to it).
/usr/bin/python3 -c "import json, sys, torch; print(json.dumps(json.loads(torch.load(sys.argv[1])['card']), indent=2))" \
  "$OUT/$NAME" > "$OUT/card.json"
(cd "$OUT" && sha256sum "$NAME" > SHA256SUMS)
cat "$OUT/card.json"
cat "$OUT/SHA256SUMS"
