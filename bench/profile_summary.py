#!/usr/bin/python3
"""Per-step time of the kernels' named scopes in a LibTorch profiler trace (Chrome format).

    CAPSNET_PROFILE_TRACE=trace.json build/bench/capsnet_bench_layers --benchmark_filter='Stages/stage:1/bf16:1'
    python3 bench/profile_summary.py trace.json [PREFIX]
    python3 bench/profile_summary.py --check      # self-test on a made-up trace

A step runs from the start of one outermost scope PREFIX + "forward" (default prefix "spectral::") to the
start of the next (so it holds that forward's backward). Each line is a scope's time per step in ms: the
median over the steps, after the first three, which hold one-time costs (oneDNN primitives built, fresh
buffers paged in: PrimaryCaps' bf16 weight spectrum took 75 ms in its first three steps, 7 ms after).
Scopes nest: "spectral::forward" contains "spectral::forward.products" etc.
"""
import collections
import json
import statistics
import sys

WARM_UP_STEPS = 3


def per_step(events, prefix):
    """{scope: [ms in step 1, ms in step 2, ...]} and [calls per step], warm-up steps dropped."""
    spans = sorted((float(e["ts"]), float(e.get("dur", 0)), e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("name", "").startswith(prefix))
    starts = [ts for ts, _, name in spans if name == prefix + "forward"]
    if len(starts) <= WARM_UP_STEPS:
        return None, None
    bounds = starts + [float("inf")]
    times = collections.defaultdict(lambda: [0.0] * len(starts))
    calls = collections.defaultdict(lambda: [0] * len(starts))
    step = 0
    for ts, dur, name in spans:
        while ts >= bounds[step + 1]:
            step += 1
        if ts < bounds[0]:
            continue
        times[name][step] += dur / 1000
        calls[name][step] += 1
    keep = slice(WARM_UP_STEPS, None)
    return ({n: t[keep] for n, t in times.items()}, {n: c[keep] for n, c in calls.items()})


def summary(events, prefix="spectral::"):
    times, calls = per_step(events, prefix)
    if times is None:
        raise SystemExit(f"fewer than {WARM_UP_STEPS + 1} {prefix}forward events in the trace")
    steps = len(times[prefix + "forward"])
    lines = [f"{steps} steps after {WARM_UP_STEPS} of warm-up; ms per step, median (calls per step)"]
    order = sorted(times, key=lambda n: (n.split(".")[0], "." in n, -statistics.median(times[n])))
    for name in order:
        lines.append(f"{name:45s} {statistics.median(times[name]):8.2f}  ({statistics.median(calls[name]):.0f})")
    return lines


def check():
    # Five steps: the first takes 100 ms in "w", the others 10; "p" runs twice per step, 2 ms each.
    events = []
    for step in range(5):
        t0 = step * 1000.0
        events.append({"ph": "X", "name": "s::forward", "ts": t0, "dur": 500.0})
        events.append({"ph": "X", "name": "s::forward.w", "ts": t0 + 1, "dur": (100.0 if step == 0 else 10.0) * 1000})
        for k in range(2):
            events.append({"ph": "X", "name": "s::backward.p", "ts": t0 + 600 + k, "dur": 2000.0})
    events.append({"ph": "X", "name": "other::x", "ts": 5.0, "dur": 1e6})
    lines = summary(events, "s::")
    got = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert lines[0].startswith("2 steps after 3"), lines
    assert got["s::forward.w"] == ["10.00", "(1)"], got
    assert got["s::backward.p"] == ["4.00", "(2)"], got
    assert "other::x" not in got, got
    try:
        summary(events[:3], "s::")
    except SystemExit as e:
        assert "fewer than 4" in str(e)
    else:
        raise AssertionError("a trace without enough steps was accepted")
    print("profile_summary: check passed")


def main(argv):
    if argv == ["--check"]:
        return check()
    if len(argv) not in (1, 2):
        sys.exit(__doc__)
    with open(argv[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    print("\n".join(summary(events, *argv[1:])))


if __name__ == "__main__":
    main(sys.argv[1:])
