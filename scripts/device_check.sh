#!/bin/bash
# The GPU check of the fused ops (docs/gpu.md), for a machine with nvcc and a CUDA PyTorch (the lent
# H100 / H200): builds libcapsnet_ops.so alone against that PyTorch's LibTorch for sm_90, runs the GPU
# tests (tests/ops/test_cuda_ops.py), then the GPU benchmark (bench/gpu_bench.py). Logs go to $OUT
# (default out/device): summary.txt (what each stage did), env.txt, build.log, tests.log, bench.log,
# bench.jsonl. Meant to finish in under 8 minutes; every stage has its own time limit and a failed
# stage does not stop the next one.
# Usage: scripts/device_check.sh [MNIST_FOLDER]   (MNIST IDX files, .gz allowed, for the epoch benchmark)
#   env: CUDA_ARCH (default 90), PYTHON (default python3), STAGES (default "build tests bench"),
#        BENCH_ONLY (passed to gpu_bench.py --only), JOBS (default: all cores)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/device}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
ARCH=${CUDA_ARCH:-90}
STAGES=${STAGES:-build tests bench}
JOBS=${JOBS:-$(nproc)}
MNIST=${1:-}
start=$(date +%s)
say() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$OUT/summary.txt"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  command -v nvcc && nvcc --version | tail -2
  cmake --version | head -1; g++ --version | head -1; nproc
} > "$OUT/env.txt" 2>&1
say "env: $(grep -m1 '^torch' "$OUT/env.txt")"

lib=""
# The C++ runtime the Python process already has (the system's libstdc++.so.6). A compiler whose own
# libstdc++ is present only as a static archive would otherwise copy parts of it (iostreams, locales) into
# the library, and formatting a number into a c10 error message then crashes (seen on the H100 image).
sysstd=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
build_cmake() {  # $1 = C++ standard, $2 = "link" to link the system libstdc++.so.6 by path
  local dir=build-cuda$1$2 prefix nvcc link=()
  [ "${2:-}" = link ] && [ -n "$sysstd" ] && link=(-DCMAKE_SHARED_LINKER_FLAGS="$sysstd")
  prefix=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 1
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  echo "=== cmake, C++$1 ===" >> "$OUT/build.log"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  TORCH_CUDA_ARCH_LIST="${ARCH:0:1}.${ARCH:1}" cmake -S . -B "$dir" "${gen[@]}" -DCAPSNET_OPS_ONLY=ON -DCAPSNET_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_STANDARD="$1" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_CUDA_FLAGS="--ptxas-options=-v" -DCMAKE_PREFIX_PATH="$prefix" "${link[@]}" >> "$OUT/build.log" 2>&1 &&
    timeout 420 cmake --build "$dir" -j "$JOBS" >> "$OUT/build.log" 2>&1 &&
    lib=$dir/capsnet/ops/libcapsnet_ops.so
}
build_extension() {  # fallback: torch.utils.cpp_extension (its own flags, ninja)
  echo "=== torch.utils.cpp_extension ===" >> "$OUT/build.log"
  mkdir -p build-cuda-ext
  ARCH=$ARCH timeout 420 $PY - >> "$OUT/build.log" 2>&1 <<'PYEOF' && lib=build-cuda-ext/capsnet_ops.so
import glob, os
from torch.utils.cpp_extension import load
src = sorted(glob.glob("capsnet/ops/*.cpp") + glob.glob("capsnet/ops/cpu/*.cpp") + glob.glob("capsnet/ops/autograd/*.cpp")
             + glob.glob("capsnet/ops/cuda/*.cu"))
arch = os.environ["ARCH"]
load(name="capsnet_ops", sources=src, extra_include_paths=[os.getcwd()], is_python_module=False,
     extra_cflags=["-O3", "-fopenmp", "-Wno-psabi"], extra_ldflags=["-fopenmp"], build_directory="build-cuda-ext",
     extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                        "--ptxas-options=-v"], verbose=True)
PYEOF
}

if [[ " $STAGES " == *" build "* ]]; then
  build_cmake 17 link || { say "build: CMake, C++17, system libstdc++ failed; trying without"; tail -5 "$OUT/build.log" | tee -a "$OUT/summary.txt"; build_cmake 17; } ||
    { say "build: CMake with C++17 failed (tail of build.log below), trying C++20"; tail -5 "$OUT/build.log" | tee -a "$OUT/summary.txt"; build_cmake 20; } ||
    { say "build: CMake failed, trying torch.utils.cpp_extension"; build_extension; }
  if [ -n "$lib" ] && [ -f "$lib" ]; then
    say "build: $lib; libstdc++: ${sysstd:-not found}; $(ldd "$lib" | grep -c 'libstdc++') dynamic, $(nm -DC --defined-only "$lib" | grep -c 'std::basic_ostream') ostream symbols defined inside (0 expected)"
    grep -E "ptxas info *: (Used|Compiling entry)" "$OUT/build.log" | grep -A1 -E "routing_pass|child_grad" |
      grep Used | sort | uniq -c | head -8 >> "$OUT/summary.txt"
    if [ "$(nm -DC --defined-only "$lib" | grep -c 'std::basic_ostream')" != 0 ] && command -v ninja >/dev/null; then
      # Which input of the link brings the C++ runtime's code in (open question, docs/gpu.md).
      dir=$(dirname "$(dirname "$(dirname "$lib")")")
      cmd=$(ninja -C "$dir" -t commands capsnet_ops | tail -1)
      { echo "=== link command"; echo "$cmd"; echo "=== trace of std::ostream::_M_insert<long>";
        (cd "$dir" && rm -f capsnet/ops/libcapsnet_ops.so && eval "$cmd -Wl,--trace-symbol=_ZNSo9_M_insertIlEERSoT_ -Wl,--verbose" 2>&1 |
          grep -E "_M_insert|libstdc|attempt to open .*stdc" | head -20); } > "$OUT/link.txt" 2>&1
      grep -E "_M_insert" "$OUT/link.txt" | head -5 >> "$OUT/summary.txt"
      # The same sources through torch.utils.cpp_extension (its own link line): used instead when clean.
      cmake_lib=$lib
      if build_extension && [ "$(nm -DC --defined-only "$lib" | grep -c 'std::basic_ostream')" = 0 ]; then
        say "build: using $lib (cpp_extension: no C++ runtime code inside) instead of $cmake_lib"
      else
        say "build: cpp_extension did not give a clean library either; testing $cmake_lib"
        lib=$cmake_lib
      fi
    fi
  else
    say "build: FAILED (errors from build.log:)"
    grep -m 12 -E "error|Error" "$OUT/build.log" | tee -a "$OUT/summary.txt"
  fi
else
  lib=$(ls -t build-cuda*/capsnet/ops/libcapsnet_ops.so build-cuda-ext/capsnet_ops.so 2>/dev/null | head -1)
fi

if [ -n "$lib" ] && [[ " $STAGES " == *" tests "* ]]; then
  timeout 200 $PY -X faulthandler tests/ops/test_cuda_ops.py "$lib" > "$OUT/tests.log" 2>&1
  rc=$?
  say "tests: exit $rc -- $(tail -1 "$OUT/tests.log")"
  if [ $rc -ge 124 ]; then  # a crash or a hang: each test alone, then a native backtrace of the first that crashes
    crashed=""
    for t in $($PY tests/ops/test_cuda_ops.py --list); do
      echo "=== $t alone" >> "$OUT/tests.log"
      timeout 60 $PY -X faulthandler tests/ops/test_cuda_ops.py "$lib" -k "$t" >> "$OUT/tests.log" 2>&1
      trc=$?
      say "  $t: exit $trc"
      [ $trc -ge 124 ] && [ -z "$crashed" ] && crashed=$t
    done
    if [ -n "$crashed" ] && command -v cuda-gdb >/dev/null; then
      timeout 120 cuda-gdb -batch -ex run -ex bt --args $PY tests/ops/test_cuda_ops.py "$lib" -k "$crashed" \
        > "$OUT/gdb.log" 2>&1
      grep -m 25 -E "^#[0-9]+|signal" "$OUT/gdb.log" >> "$OUT/summary.txt"
    fi
  fi
  grep -E "^FAIL|Error:|assert|Fatal Python|File " "$OUT/tests.log" | head -30 >> "$OUT/summary.txt"
fi

if [ -n "$lib" ] && [[ " $STAGES " == *" bench "* ]]; then
  args=(--ops-library "$lib" --out "$OUT/bench.jsonl")
  [ -n "$MNIST" ] && args+=(--mnist "$MNIST")
  [ -n "${BENCH_ONLY:-}" ] && args+=(--only "$BENCH_ONLY")
  PYTHONUNBUFFERED=1 timeout 260 $PY bench/gpu_bench.py "${args[@]}" > "$OUT/bench.log" 2>&1
  say "bench: exit $? ($(wc -l < "$OUT/bench.jsonl" 2>/dev/null || echo 0) results)"
  $PY - "$OUT/bench.jsonl" <<'PYEOF' 2>/dev/null | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keys = [k for k in ("impl", "dtype", "precision", "batch", "fwd_bwd_ms", "fwd_ms", "step_ms", "epoch_s", "img_s",
                        "peak_mb", "test_accuracy", "rel_diff_vs_fused", "error") if k in r and r[k] is not None]
    print(r["bench"], " ".join(f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in keys))
PYEOF
fi
say "done"
