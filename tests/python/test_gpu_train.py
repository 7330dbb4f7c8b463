"""apps/gpu/train.py (the GPU trainer of python/capsnet) on the CPU, on generated IDX data.

usage: python3 test_gpu_train.py /path/to/capsnet /path/to/libcapsnet_ops.so

Checks: the shift augmentation against a per-pixel loop; the learning rates against the ones `capsnet
train` logs for the same schedule; the weights' moving average against its formula; a two-epoch run with a
validation split writes an eval record per split and epoch, keeps the epoch the rule picks
(docs/runs/epochs.py) in best.pt, and `capsnet eval` reads best.pt and scores it as Python does; the time
probe plans the epochs; --resave; the errors (missing or truncated data, a split too large, not a weight file).
Exit status 0 when everything passes.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "apps", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "docs", "runs"))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import capsnet  # noqa: E402
import epochs as run_epochs  # noqa: E402
import affine_cnn  # noqa: E402
import train as gpu_train  # noqa: E402
from pytest_lite import run_tests  # noqa: E402
from test_interop import write_fake_mnist  # noqa: E402

CLI = OPS = WORK = None
TRAIN = os.path.join(ROOT, "apps", "gpu", "train.py")


def cli(*args, expect_ok=True):
    p = subprocess.run([CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (p.returncode == 0) == expect_ok, f"capsnet {' '.join(args)} exited {p.returncode}:\n{p.stdout}"
    return p.stdout


def trainer(*args, expect_ok=True):
    p = subprocess.run([sys.executable, TRAIN, "--ops-library", OPS, "--device", "cpu", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (p.returncode == 0) == expect_ok, f"train.py {' '.join(args)} exited {p.returncode}:\n{p.stdout}"
    return p.stdout


def data_dir():
    return os.path.join(WORK, "data")


def test_shift_matches_a_loop():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(12, 1, 7, 9, generator=g)
    dx = torch.tensor([-2, -1, 0, 1, 2, 2, -2, 0, 1, -1, 2, -2])
    dy = torch.tensor([0, 2, -2, 1, -1, 2, -2, 0, 0, 1, -2, 2])
    got = gpu_train.shifted(x, dx, dy)
    want = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for r in range(7):
            for c in range(9):
                rs, cs = r - int(dy[b]), c - int(dx[b])
                if 0 <= rs < 7 and 0 <= cs < 9:
                    want[b, 0, r, c] = x[b, 0, rs, cs]
    assert torch.equal(got, want)


def test_learning_rates_equal_the_cpp_tools():
    out = os.path.join(WORK, "lr-run")
    for schedule, lr in (("fast", "3e-3"), ("paper", "1e-3")):
        cli("train", "--data", data_dir(), "--schedule", schedule, "--lr", lr, "--epochs", "3", "--batch-size", "8",
            "--log-every", "1", "--no-eval", "--no-progress", "--threads", "1", "--out", out)
        recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        total = [r for r in recs if r.get("event") == "start"][-1]["train"].get("schedule_steps", 0)
        train = [r for r in recs if r.get("event") == "train"]
        assert len(train) >= 6, train
        for r in train:
            # The C++ record of step s holds the rate that step s ran with: step index s - 1.
            want = gpu_train.learning_rate(schedule, float(lr), r["step"] - 1, total or len(train))
            assert math.isclose(r["lr"], want, rel_tol=1e-9), (schedule, r["step"], r["lr"], want)
        subprocess.run(["rm", "-rf", out], check=True)
    # The paper's schedule over its own units: x0.96 per 2,000 steps.
    assert math.isclose(gpu_train.learning_rate("paper", 1e-3, 4000, 0), 1e-3 * 0.96 ** 2, rel_tol=1e-12)


def test_weight_average_formula():
    p = [torch.nn.Parameter(torch.tensor([1.0, 2.0]))]
    avg = gpu_train.WeightAverage(p, 0.9)
    with torch.no_grad():
        p[0].copy_(torch.tensor([3.0, 6.0]))
    avg.update(1)  # d = min(0.9, 2 / 11)
    d = 2 / 11
    assert torch.allclose(avg.avg[0], torch.tensor([1.0, 2.0]) * d + torch.tensor([3.0, 6.0]) * (1 - d))
    avg.update(1000)  # d = 0.9
    a1 = torch.tensor([1.0, 2.0]) * d + torch.tensor([3.0, 6.0]) * (1 - d)
    assert torch.allclose(avg.avg[0], a1 * 0.9 + torch.tensor([3.0, 6.0]) * 0.1)
    avg.swap()
    assert torch.allclose(p[0].detach(), a1 * 0.9 + torch.tensor([3.0, 6.0]) * 0.1)


def test_run_with_validation_keeps_the_rules_epoch():
    out = os.path.join(WORK, "run")
    log = trainer("--data", data_dir(), "--out", out, "--epochs", "2", "--batch-size", "8", "--val", "16",
                  "--schedule", "fast", "--seed", "5", "--ema-decay", "0.5", "--log-every", "2")
    assert "epoch 2:" in log and "best validation: epoch" in log, log
    ep = run_epochs.epochs(os.path.join(out, "metrics.jsonl"))
    assert ep["epochs"] == [1, 2], ep
    recs = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    bests = [r for r in recs if r["event"] == "best"]
    assert round(bests[-1]["epoch"]) == ep["best"], (bests, ep["best"])
    assert all(r["weights"] == "average" for r in recs if r["event"] == "eval")
    # best.pt: a capsnet weight file that the C++ tool reads; both sides score it alike.
    d = capsnet.read_weights(os.path.join(out, "best.pt"))
    card = json.loads(d["card"])
    assert card["epoch"] == ep["best"] and card["seed"] == 5 and d["storage"] == "fp16", card
    assert all(t.dtype == torch.float16 for t in d["state_dict"].values())
    res = json.loads(cli("eval", "--checkpoint", os.path.join(out, "best.pt"), "--data", data_dir(), "--json",
                         "--no-progress", "--threads", "1"))
    model = capsnet.load(os.path.join(out, "best.pt"), ops_library=OPS).float()
    x, y = gpu_train.load_split(data_dir(), "t10k")
    with torch.no_grad():
        py_correct = (model(x.float().div(255).unsqueeze(1)).lengths.argmax(1) == y).sum().item()
    assert res["examples"] == x.shape[0], res
    assert abs(round(res["accuracy"] * x.shape[0]) - py_correct) <= 1, (res["accuracy"], py_correct)
    assert os.path.isfile(os.path.join(out, "last.pt"))


def test_time_probe_plans_the_epochs():
    out = os.path.join(WORK, "probe")
    log = trainer("--data", data_dir(), "--out", out, "--epochs", "50", "--minutes", "0.02", "--batch-size", "8",
                  "--val", "16", "--test-limit", "8")
    assert "time probe:" in log, log
    start = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    planned = start["options"]["epochs_planned"]
    assert 1 <= planned < 50 and start["probe"]["epochs_fit"] >= 1, start
    assert f"epoch {planned}:" in log and f"epoch {planned + 1}:" not in log, log


def test_resave_and_errors():
    src = os.path.join(WORK, "run", "best.pt")
    dst = os.path.join(WORK, "resaved.pt")
    log = trainer("--resave", src, dst)
    assert "wrote" in log and capsnet.read_weights(dst)["step"] == capsnet.read_weights(src)["step"], log
    log = trainer("--resave", os.path.join(WORK, "data", "t10k-labels-idx1-ubyte"), dst, expect_ok=False)
    assert "not a capsnet weight file" in log, log
    log = trainer("--data", data_dir(), "--out", os.path.join(WORK, "run"), expect_ok=False)
    assert "holds a previous run" in log and "--overwrite" in log, log
    assert capsnet.read_weights(src)["step"] > 0  # untouched
    log = trainer("--data", os.path.join(WORK, "absent"), "--out", os.path.join(WORK, "e"), expect_ok=False)
    assert "not found in" in log, log
    log = trainer("--data", data_dir(), "--out", os.path.join(WORK, "e"), "--val", "1000", expect_ok=False)
    assert "leaves no training images" in log, log
    bad = os.path.join(WORK, "bad")
    os.makedirs(bad)
    for name in os.listdir(data_dir()):
        with open(os.path.join(data_dir(), name), "rb") as f:
            blob = f.read()
        with open(os.path.join(bad, name), "wb") as f:
            f.write(blob[:-5] if name.startswith("train-images") else blob)
    log = trainer("--data", bad, "--out", os.path.join(WORK, "e"), expect_ok=False)
    assert "truncated" in log, log


def test_affine_cnn_scores_as_the_cpp_model():
    sets = os.path.join(WORK, "sets")
    cli("affine", "--write-sets", sets, "--data", data_dir(), "--test-limit", "0", "--threads", "1")
    for pool in (True, False):
        out = os.path.join(WORK, f"affine-{pool}")
        saved = os.path.join(WORK, f"affine-{pool}.pt")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "apps", "gpu", "affine_cnn.py"), "--data", data_dir(),
                            "--sets", sets, "--out", out, "--small", "--epochs", "2", "--target-accuracy", "0",
                            "--val", "16", "--batch-size", "8", "--device", "cpu", "--save", saved, "--seed", "4"]
                           + (["--pool"] if pool else []), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert p.returncode == 0, p.stdout
        res = json.load(open(os.path.join(out, "results.json")))
        files = json.load(open(os.path.join(sets, "sets.json")))["files"]
        assert set(res["sets"]) == set(files) and res["epochs_trained"] == 2, res
        for name in ("affnist-style", "rotation-45"):
            got = json.loads(cli("eval", "--checkpoint", saved, "--images", os.path.join(sets, files[name]["images"]),
                                 "--labels", os.path.join(sets, files[name]["labels"]), "--json", "--no-progress",
                                 "--threads", "1"))
            n = files[name]["examples"]
            assert abs(round(got["accuracy"] * n) - round(res["sets"][name] * n)) <= 1, (pool, name, got, res)
        # The same network on both sides: the C++ model's logits on its probe images (capsnet export --probe)
        # equal the Python module's with the file's weights.
        probe = os.path.join(WORK, f"probe-{pool}.pt")
        cli("export", "--checkpoint", saved, "--probe", "6", "--out", probe, "--threads", "1")
        d = torch.load(probe)
        model = affine_cnn.BaselineCnn(json.loads(d["config"]))
        model.load_state_dict({k: v.float() for k, v in d["state_dict"].items()})
        model.eval()
        with torch.no_grad():
            logits = model(d["probe"]["images"].float())
        err = (logits - d["probe"]["logits"].float()).abs().max().item()
        assert err < 1e-4 * max(1.0, d["probe"]["logits"].abs().max().item()), (pool, err)


def main():
    global CLI, OPS, WORK
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    CLI, OPS = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    capsnet.load_library(OPS)
    with tempfile.TemporaryDirectory(prefix="capsnet_gpu_train_") as work:
        WORK = work
        write_fake_mnist(data_dir(), 56, 24)
        failed = run_tests((test_shift_matches_a_loop, test_learning_rates_equal_the_cpp_tools,
                            test_weight_average_formula, test_run_with_validation_keeps_the_rules_epoch,
                            test_time_probe_plans_the_epochs, test_resave_and_errors,
                            test_affine_cnn_scores_as_the_cpp_model))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
