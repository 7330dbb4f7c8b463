#!/usr/bin/env bash
# Quick start 2: set up (packages, MNIST, build) and run the whole test suite with CTest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT/build"
ctest --output-on-failure --timeout 1500 "$@"
