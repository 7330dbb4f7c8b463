#!/bin/bash
# Readies this checkout for scripts/device_train.sh on a lent GPU machine (docs/gpu.md): the data as
# gzipped IDX files in data/device/<dataset>/ and the affine test sets in data/device/affine-sets/ (git-ignored;
# name the folders a call needs in the device tool's carry: all of them exceed its 64 MiB),
# and, because the device tool sends at most 64 MiB of tracked and untracked files while the shipped
# models alone are ~70 MB, `slim` takes models/*/*.pt out of git's index and moves them to
# /tmp/capsnet-slim for the call, `unslim` puts them back (if /tmp was lost: git checkout -- models).
# Commit nothing in between.
# Usage: scripts/device_data.sh data | slim | unslim
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  data)
    mkdir -p data/device/mnist data/device/fashion-mnist
    for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
      [ -f data/device/mnist/$f.gz ] || gzip -9 -c data/mnist/$f > data/device/mnist/$f.gz
      [ -f data/device/fashion-mnist/$f.gz ] || cp /usr/share/datasets/fashion-mnist/$f.gz data/device/fashion-mnist/
    done
    if [ ! -f data/device/affine-sets/sets.json ]; then  # the affine experiment's 14 test sets (33 MB gzipped)
      build/bin/capsnet affine --write-sets data/device/affine-sets --test-limit 0 --threads 1 > /dev/null
      gzip -9 data/device/affine-sets/*-ubyte
    fi
    du -sh data/device/* ;;
  slim)
    files=$(git ls-files 'models/*.pt')
    [ -n "$files" ] || { echo "nothing to slim (already slim?)"; exit 0; }
    mkdir -p /tmp/capsnet-slim
    for f in $files; do mkdir -p "/tmp/capsnet-slim/$(dirname "$f")"; mv "$f" "/tmp/capsnet-slim/$f"; done
    git rm -q --cached $files
    echo "$(echo "$files" | wc -l) model files moved out; tracked files now $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes" ;;
  unslim)
    (cd /tmp/capsnet-slim 2>/dev/null && find models -name '*.pt') | while read -r f; do mv "/tmp/capsnet-slim/$f" "$f"; done
    git reset -q -- models
    git checkout -- models  # whatever did not come back from /tmp
    git status --short models | head -3
    echo "models back: $(git ls-files 'models/*.pt' | wc -l) files" ;;
  *) echo "usage: $0 data | slim | unslim" >&2; exit 2 ;;
esac
