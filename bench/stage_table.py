#!/usr/bin/python3
"""The per-stage table of docs/kernels.md from capsnet_bench_layers' JSON output.

    build/bench/capsnet_bench_layers --benchmark_filter='GemmProbe|Stages' --benchmark_repetitions=5 \
        --benchmark_format=json > stages.json
    python3 bench/stage_table.py stages.json

Medians over the repetitions; each stage's nominal GFLOP/s (the direct convolutions' FLOP count, see
bench/bench_layers.cpp) as a share of the GEMM probe of its own precision, measured in the same run.
"""
import json
import sys

STAGES = ["Conv1 (forward + weight gradient)", "PrimaryCaps (forward + both gradients)",
          "DigitCaps: predictions + 3 routing iterations, forward + backward",
          "decoder (forward + both gradients)", "Adam step (fused)", "whole step (forward, loss, backward, Adam)"]


def medians(path):
    with open(path) as f:
        report = json.load(f)
    rows = {}
    for b in report["benchmarks"]:
        # With repetitions, only the median aggregates; with one run, the runs themselves.
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if b.get("run_type") == "iteration" and any(
                x.get("run_type") == "aggregate" for x in report["benchmarks"]):
            continue
        rows[b["run_name"]] = b
    return report["context"], rows


def main(path):
    context, rows = medians(path)
    probe = {}
    for bf16 in (0, 1):
        name = f"GemmProbe/bf16:{bf16}/iterations:1"
        probe[bf16] = rows[name]["GFLOP/s"] if name in rows and "GFLOP/s" in rows[name] else None
    fmt_probe = lambda p: "n/a" if p is None else f"{p:.0f}"
    print(f"{context.get('host_name', '?')}, {context.get('num_cpus', '?')} CPUs, {context.get('date', '')}; "
          f"GEMM probe fp32 {fmt_probe(probe[0])} GFLOP/s, bf16 {fmt_probe(probe[1])} GFLOP/s\n")
    print("| stage (batch 100) | fp32 ms | fp32 GFLOP/s | % of fp32 probe | bf16 ms | bf16 GFLOP/s "
          "| % of bf16 probe |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, label in enumerate(STAGES):
        cells = []
        for bf16 in (0, 1):
            b = rows.get(f"Stages/stage:{i}/bf16:{bf16}/real_time")
            if b is None or b.get("error_occurred"):
                cells += ["–", "–", "–"]
                continue
            assert b["time_unit"] == "ms", b["time_unit"]
            g = b.get("GFLOP/s")
            share = "–" if g is None or probe[bf16] is None else f"{100 * g / probe[bf16]:.0f}%"
            cells += [f"{b['real_time']:.1f}", "–" if g is None else f"{g:.0f}", share]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
