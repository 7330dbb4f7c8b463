#!/usr/bin/python3
"""Per-step time of the kernels' named scopes in a LibTorch profiler trace (Chrome format).

    CAPSNET_PROFILE_TRACE=trace.json build/bench/capsnet_bench_layers --benchmark_filter='Stages/stage:1/bf16:1'
    python3 bench/profile_summary.py trace.json [PREFIX]

Sums the durations of the events whose name starts with PREFIX (default "spectral::") and divides them by
the number of calls of the outermost scope PREFIX + "forward" (one per training step), so each line is
milliseconds per step. Scopes nest: "spectral::forward" contains "spectral::forward.products" etc.
"""
import collections
import json
import sys


def main(path, prefix="spectral::"):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total = collections.Counter()
    calls = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith(prefix):
            total[name] += float(e.get("dur", 0))
            calls[name] += 1
    steps = calls.get(prefix + "forward", 0)
    if steps == 0:
        sys.exit(f"no {prefix}forward events in {path}")
    print(f"{steps} steps; ms per step (calls per step)")
    order = sorted(total, key=lambda n: (n.split(".")[0], "." in n, -total[n]))
    for name in order:
        print(f"{name:45s} {total[name] / steps / 1000:8.2f}  ({calls[name] / steps:.0f})")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
