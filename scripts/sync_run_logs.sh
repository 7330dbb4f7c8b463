#!/bin/bash
# Copies long runs' logs and per-epoch metrics into the repository, so that their progress outlives the
# machine (runs/ is not in git): for every run directory PREFIX<tag>/ or log PREFIX<tag>.log, writes
# DEST/<tag>.log and DEST/<tag>.metrics.jsonl; any further FILEs (the lane script that runs them) are
# copied into DEST as they are. Commit DEST afterwards (git add -f: docs/runs holds copies of runs/).
# Usage: scripts/sync_run_logs.sh DEST PREFIX [FILE...]
#   e.g. scripts/sync_run_logs.sh docs/runs/mnist-ema120 runs/mnist-ema120- runs/mnist-ema-lane.sh
set -eu
if [ $# -lt 2 ]; then
  echo "usage: $0 DEST PREFIX [FILE...]   (e.g. $0 docs/runs/mnist-ema120 runs/mnist-ema120-)" >&2
  exit 2
fi
dest=$1 prefix=$2
shift 2
mkdir -p "$dest"
found=0
for path in "$prefix"*; do
  [ -e "$path" ] || continue
  tag=${path#"$prefix"}
  case $tag in */*) continue ;; esac
  # A run has both PREFIX<tag>/ and PREFIX<tag>.log: copy it once, from its log's entry when it has one.
  if [ -d "$path" ] && [ -f "$path.log" ]; then continue; fi
  tag=${tag%.log}
  if [ -f "$prefix$tag.log" ]; then cp "$prefix$tag.log" "$dest/$tag.log"; found=1; fi
  if [ -f "$prefix$tag/metrics.jsonl" ]; then cp "$prefix$tag/metrics.jsonl" "$dest/$tag.metrics.jsonl"; found=1; fi
done
[ $found = 1 ] || { echo "$0: no run matches $prefix*" >&2; exit 1; }
for f in "$@"; do cp "$f" "$dest/"; done
