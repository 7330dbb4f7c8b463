#!/usr/bin/env bash
# Turns a training checkpoint into the shipped model: weights (fp16 by default) + model card + SHA-256.
#   scripts/ship_model.sh CHECKPOINT OUT_DIR "COMMAND THAT TRAINED IT" [DATASET]
# Writes OUT_DIR/capsnet-<dataset>.pt (weights only, fp16 storage unless STORAGE says otherwise, an
# 8-image probe for ports, the card inside as JSON), OUT_DIR/card.json and OUT_DIR/SHA256SUMS. The card's accuracy is measured on
# the stored file itself, over the whole test split, so `capsnet eval` on it prints exactly that.
# Any network: a CapsNet checkpoint, one of `capsnet em` (matrix capsules, EM routing), or the baseline CNN
# of `capsnet affine` / `capsnet stn`.
# Environment: NAME (file stem, default capsnet-<dataset>), STEPS_PER_EPOCH (for the card's epochs;
# default 600, i.e. 60,000 images at batch 100; `capsnet em` at batch 32: 1875), STORAGE (fp16 by
# default; fp32 or bf16), CARD_EXTRA (a JSON object merged into the card, e.g. the validation rule,
# validation accuracy and seed of a run with --val), EVAL_ARGS (what the card's accuracy is measured on;
# default `--dataset DATASET`, e.g. `--images X --labels Y` for a 40x40 model and a set written by
# `capsnet affine --write-sets`). DATASET multimnist: a model of `capsnet multimnist`, scored by
# `capsnet multimnist --eval-only` (fp32) on its 10,000 fixed test pairs; EVAL_ARGS then adds to that command
# (e.g. `--test-size 1000`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLI="${CAPSNET_CLI:-$ROOT/build/bin/capsnet}"  # CAPSNET_CLI: another build of the tool
CKPT="$1"; OUT="$2"; COMMAND="$3"; DATASET="${4:-mnist}"
NAME="${NAME:-capsnet-$DATASET}.pt"
STEPS_PER_EPOCH="${STEPS_PER_EPOCH:-600}"
STORAGE="${STORAGE:-fp16}"
default_eval="--dataset $DATASET"; [[ "$DATASET" == multimnist ]] && default_eval=""  # its pairs come from MNIST
read -r -a EVAL <<< "${EVAL_ARGS:-$default_eval}"
mkdir -p "$OUT"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT

"$CLI" export --checkpoint "$CKPT" --storage "$STORAGE" --probe 8 --out "$tmp/w.pt"
if [[ "$DATASET" == multimnist ]]; then  # pairs of digits: scored by capsnet multimnist on its fixed test pairs
  "$CLI" multimnist --eval-only --checkpoint "$tmp/w.pt" --precision fp32 --figure-correct 0 --figure-wrong 0 \
    --no-progress --out "$tmp/mm" "${EVAL[@]}" > /dev/null
  cp "$tmp/mm/multimnist.json" "$tmp/eval.json"
else
  "$CLI" eval --checkpoint "$tmp/w.pt" "${EVAL[@]}" --json --no-progress > "$tmp/eval.json"
fi
CARD_EXTRA="${CARD_EXTRA:-{\}}" /usr/bin/python3 - "$tmp/eval.json" "$CKPT" "$tmp/w.pt" "$DATASET" "$COMMAND" "$STEPS_PER_EPOCH" "$STORAGE" > "$tmp/card.json" <<'EOF'
import json, os, sys, torch
ev = json.load(open(sys.argv[1]))
ckpt, weights, dataset, command, steps_per_epoch = sys.argv[2], torch.load(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
storage = sys.argv[7]
step = weights["step"]
c = json.loads(weights["config"])
if weights.get("model", "capsnet") == "matrix-capsnet":
    model = (f"Matrix capsules with EM routing (Hinton, Sabour & Frosst 2018): ReLU Conv1 A={c['conv1_channels']}@5x5, "
             f"PrimaryCaps B={c['primary_types']}, ConvCaps1 C={c['conv1_caps_types']}, ConvCaps2 D={c['conv2_caps_types']}, "
             f"class capsules with coordinate addition, 4x4 poses, {c['routing_iterations']} EM iterations")
elif weights.get("model") == "baseline-cnn":
    model = (f"Baseline CNN (Sabour et al. 2017, Sec. 5): 3 conv {c['kernel_size']}x{c['kernel_size']} "
             f"{c['conv1_channels']}/{c['conv2_channels']}/{c['conv3_channels']}"
             f"{', 2x2 max-pool after conv1 and conv2' if c['pooling'] else ', no pooling'}, "
             f"FC {c['fc1_units']}/{c['fc2_units']}, dropout {c['dropout']}"
             f"{', spatial transformer' if c.get('stn') else ''}; {c['image_size']}x{c['image_size']} inputs")
else:
    model = "CapsNet (Sabour et al. 2017): Conv1 256@9x9, PrimaryCaps 32x8D, DigitCaps 10x16D, r=3, decoder"
    if c.get("image_size", 28) != 28:
        model += f"; {c['image_size']}x{c['image_size']} inputs"
meta_epochs = step / steps_per_epoch
card = {
    "model": model,
    "dataset": dataset,
    "command": command,
    "steps": step,
    "epochs": round(meta_epochs, 3),
    "precision": "trained with fp32 master weights (see docs/results.md for the compute precision per epoch); stored " + storage,
    "storage": storage,
}
if dataset == "multimnist":  # capsnet multimnist --eval-only's summary
    card.update({
        "pairs_seen": ev["images_seen"],
        "test_accuracy": ev["accuracy"],  # both digits of a pair among the two longest capsules
        "test_error": round(ev["error"], 6),
        "test_errors": round(ev["error"] * ev["test_examples"]),
        "digits_found": ev["digit_accuracy"],
        "test_examples": ev["test_examples"],
        "test_loss": ev["test_loss"],
        "evaluated_with": f"capsnet multimnist --eval-only on this file (fp32 compute), {ev['test_examples']} generated "
                          f"test pairs (test seed {ev['test_seed']}, overlay {ev['overlay']}) from the MNIST test split",
    })
else:
    wrong = ev["examples"] - sum(ev["confusion"][k][k] for k in range(len(ev["confusion"])))
    card.update({
        "test_accuracy": ev["accuracy"],
        "test_errors": wrong,
        "test_examples": ev["examples"],
        "evaluated_with": "capsnet eval on this file (fp32 compute), " + ev["split"] if ev["split"] not in ("test", "train") else "capsnet eval on this file (fp32 compute), whole test split",
    })
card.update(json.loads(os.environ["CARD_EXTRA"]))
print(json.dumps(card, indent=2))
EOF
"$CLI" export --checkpoint "$tmp/w.pt" --storage "$STORAGE" --probe 8 --card "$tmp/card.json" --out "$OUT/$NAME"
# The card as stored in the file (export adds the class names, image fit and dataset to it).
/usr/bin/python3 -c "import json, sys, torch; print(json.dumps(json.loads(torch.load(sys.argv[1])['card']), indent=2))" \
  "$OUT/$NAME" > "$OUT/card.json"
(cd "$OUT" && sha256sum "$NAME" > SHA256SUMS)
cat "$OUT/card.json"
cat "$OUT/SHA256SUMS"
