#!/usr/bin/env bash
# Scores a 40x40 model (checkpoint or weight file) on every test set written by
# `capsnet affine --write-sets DIR`, one `capsnet eval` per set, and prints one JSON object
# {"model": ..., "sets_dir": ..., "accuracy": {stem: accuracy}} (stems as in DIR/sets.json).
#   scripts/score_affine_sets.sh MODEL DIR [extra eval flags, e.g. --threads 2]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLI="${CAPSNET_CLI:-$ROOT/build/bin/capsnet}"
MODEL="$1"; DIR="$2"; shift 2
[ -f "$DIR/sets.json" ] || { echo "score_affine_sets: $DIR/sets.json missing (write the sets with capsnet affine --write-sets $DIR)" >&2; exit 2; }
sets=$(/usr/bin/python3 -c "import json, sys
for stem, f in json.load(open(sys.argv[1]))['files'].items(): print(stem, f['images'], f['labels'])" "$DIR/sets.json")
results=()
while read -r stem images labels; do
  acc=$("$CLI" eval --checkpoint "$MODEL" --images "$DIR/$images" --labels "$DIR/$labels" \
        --json --no-progress "$@" < /dev/null | /usr/bin/python3 -c "import json, sys; print(json.load(sys.stdin)['accuracy'])")
  echo "$stem: $acc" >&2
  results+=("\"$stem\": $acc")
done <<< "$sets"
IFS=,; echo "{\"model\": \"$MODEL\", \"sets_dir\": \"$DIR\", \"accuracy\": {${results[*]}}}"
