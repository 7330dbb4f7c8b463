#!/usr/bin/python3
"""The per-stage table of docs/kernels.md from capsnet_bench_layers' JSON output.

    build/bench/capsnet_bench_layers --benchmark_filter='GemmProbe|Stages' --benchmark_repetitions=5 \
        --benchmark_format=json > stages.json
    python3 bench/stage_table.py stages.json [SIDE]      # SIDE 28 (default) or 40: the image side of the model
    python3 bench/stage_table.py --check build/bench/capsnet_bench_layers   # the CTest bench.stage_table

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


def main(path, side=28):
    context, rows = medians(path)
    probe = {}
    for bf16 in (0, 1):
        name = f"GemmProbe/bf16:{bf16}/iterations:1"
        probe[bf16] = rows[name]["GFLOP/s"] if name in rows and "GFLOP/s" in rows[name] else None
    fmt_probe = lambda p: "n/a" if p is None else f"{p:.0f}"
    print(f"{context.get('host_name', '?')}, {context.get('num_cpus', '?')} CPUs, {context.get('date', '')}; "
          f"GEMM probe fp32 {fmt_probe(probe[0])} GFLOP/s, bf16 {fmt_probe(probe[1])} GFLOP/s\n")
    print(f"| stage (batch 100, {side}x{side}) | fp32 ms | fp32 GFLOP/s | % of fp32 probe | bf16 ms | bf16 GFLOP/s "
          "| % of bf16 probe |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, label in enumerate(STAGES):
        cells = []
        for bf16 in (0, 1):
            b = rows.get(f"Stages/stage:{i}/bf16:{bf16}/side:{side}/real_time")
            if b is None or b.get("error_occurred"):
                cells += ["–", "–", "–"]
                continue
            assert b["time_unit"] == "ms", b["time_unit"]
            g = b.get("GFLOP/s")
            share = "–" if g is None or probe[bf16] is None else f"{100 * g / probe[bf16]:.0f}%"
            cells += [f"{b['real_time']:.1f}", "–" if g is None else f"{g:.0f}", share]
        print(f"| {label} | " + " | ".join(cells) + " |")


def check(binary):
    """CTest bench.stage_table: runs the quick stages (DigitCaps, decoder, Adam) and the fp32 probe three times each,
    and checks the table is made of them and the FLOP accounting: GFLOP/s = the stage's nominal GFLOP per
    step (bench_layers.cpp, apps::forward_flops) / its median real time."""
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([binary, "--benchmark_filter=GemmProbe/bf16:0|Stages/stage:[234]/bf16:0/side:28",
                        "--benchmark_repetitions=3", "--benchmark_min_time=0.01", "--benchmark_format=json",
                        f"--benchmark_out={out.name}", "--benchmark_out_format=json"],
                       check=True, stdout=subprocess.DEVNULL)
        _, rows = medians(out.name)
        nominal = {2: 3 * (2949120 + 2211840) * 100 / 1e9, 3: 3 * 2818048 * 100 / 1e9}  # GFLOP per step
        for stage, gflop in nominal.items():
            b = rows[f"Stages/stage:{stage}/bf16:0/side:28/real_time"]
            expected = gflop / (b["real_time"] / 1000)
            assert abs(b["GFLOP/s"] / expected - 1) < 0.02, (stage, b["GFLOP/s"], expected)
        assert "GFLOP/s" not in rows["Stages/stage:4/bf16:0/side:28/real_time"], "Adam has no FLOP count"
        assert rows["GemmProbe/bf16:0/iterations:1"]["GFLOP/s"] > 0
        import contextlib
        import io
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            main(out.name)
    table = text.getvalue()
    assert "| decoder (forward + both gradients) | " in table and "| Adam step (fused) | " in table, table
    assert "| Conv1 (forward + weight gradient) | – | – | – |" in table, "stages not run are dashes"
    print(table)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(sys.argv[2])
    elif len(sys.argv) in (2, 3):
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 28)
    else:
        sys.exit(__doc__)
