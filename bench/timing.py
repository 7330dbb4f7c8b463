"""Timing helper shared by the bench/ micro-benchmarks (run as `python3 bench/NAME.py`, so this
folder is on sys.path)."""
import statistics
import time


def median_seconds(fn, reps, warmup=1):
    """Median wall time of `reps` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)
