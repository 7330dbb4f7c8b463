"""apps/gpu/multimnist.py (the GPU trainer of the MultiMNIST CapsNet) on the CPU, against the C++ tool.

usage: python3 test_gpu_multimnist.py /path/to/capsnet /path/to/libcapsnet_ops.so

Checks: the ported pair generator against the C++ one (the mean bounding-box overlaps of the test pairs agree
to 1e-12, a fingerprint of every pair's digits and shifts; with MNIST present, those of the 10,000 real test
pairs equal the figures the C++ tool logged in docs/runs/multimnist-full-s41.json); the model's loss and
metric against `capsnet multimnist --eval-only` on the same weights and pairs; the learning rates against the
ones the C++ tool logs; a run's weight file, split into parts and joined, read by the C++ tool with the
training options of its card (overlay, steps, batch); the time probe and --final-lr; the errors.
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
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import capsnet  # noqa: E402
import multimnist as mm  # noqa: E402
import train as gpu_train  # noqa: E402
from pytest_lite import run_tests  # noqa: E402
from test_interop import write_fake_mnist  # noqa: E402

CLI = OPS = WORK = None
SCRIPT = os.path.join(ROOT, "apps", "gpu", "multimnist.py")
NARROW = ["--conv1-channels", "4", "--primary-types", "2"]  # the C++ test's narrow model: fast at 36x36


def cli(*args, expect_ok=True):
    p = subprocess.run([CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (p.returncode == 0) == expect_ok, f"capsnet {' '.join(args)} exited {p.returncode}:\n{p.stdout}"
    return p.stdout


def trainer(*args, expect_ok=True):
    p = subprocess.run([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (p.returncode == 0) == expect_ok, f"multimnist.py {' '.join(args)} exited {p.returncode}:\n{p.stdout}"
    return p.stdout


def train(out, *extra, expect_ok=True):
    return trainer("--data", data_dir(), "--out", out, "--device", "cpu", "--ops-library", OPS, "--batch-size", "4",
                   "--test-size", "20", *NARROW, *extra, expect_ok=expect_ok)


def data_dir():
    return os.path.join(WORK, "data")


def cpp_eval(weights, out, *extra):
    cli("multimnist", "--data", data_dir(), "--eval-only", "--checkpoint", weights, "--out", out, "--test-size", "20",
        "--precision", "fp32", "--figure-correct", "0", "--figure-wrong", "0", "--no-progress", "--threads", "1",
        *extra)
    return json.load(open(os.path.join(out, "multimnist.json")))


def test_run_is_scored_alike_by_the_cpp_tool():
    out = os.path.join(WORK, "run")
    log = train(out, "--steps", "6", "--overlay", "max", "--eval-every", "3", "--log-every", "1", "--part-mib", "1")
    parts = sorted(p for p in os.listdir(out) if p.startswith("model.part"))
    assert len(parts) >= 2 and not os.path.exists(os.path.join(out, "model.pt")), (parts, log)
    for p in parts:  # each part within 1 MiB of tensors, unless one tensor alone is larger
        state = torch.load(os.path.join(out, p))["state_dict"]
        size = sum(v.numel() * v.element_size() for v in state.values())
        assert size <= 2 ** 20 or len(state) == 1, (p, size, list(state))
        assert all(v.dtype == torch.float16 for v in state.values())
    joined = os.path.join(WORK, "joined.pt")
    trainer("--join", joined, *[os.path.join(out, p) for p in parts])
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [r for r in recs if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6], evals

    # The joined file through the C++ tool: the card's training options say overlay max, 6 steps of 4 pairs.
    c = cpp_eval(joined, os.path.join(WORK, "cpp-eval"))
    assert c["mode"] == "eval-only" and c["overlay"] == "max", c
    assert c["steps"] == 6 and c["images_seen"] == 24 and c["train_seed"] == 1, c
    # The same weights (as stored: fp16) and the same pairs in Python.
    model = capsnet.load(joined, ops_library=OPS).float()
    pairs = mm.Pairs(*gpu_train.load_split(data_dir(), "t10k"), 1001, "max")
    py = mm.evaluate(model, pairs, 20, torch.device("cpu"), "fp32")
    for key in ("mean_iou", "mean_over_smaller"):  # the generator: every pair's boxes
        want = py["overlap_iou" if key == "mean_iou" else "overlap_over_smaller"]
        assert abs(c["overlap"][key] - want) < 1e-12, (key, c["overlap"], py)
    assert c["overlap"]["examples"] == 20, c
    assert abs(c["test_loss"] - py["loss"]) <= 1e-5 * abs(py["loss"]), (c["test_loss"], py["loss"])
    # The pair metric equals unless a near-tie of the second and third longest capsule could flip it.
    x, _, y = pairs.batch(0, 20)
    with torch.no_grad():
        lengths = model(x).lengths
    top3 = lengths.topk(3, 1).values
    if (top3[:, 1] - top3[:, 2]).min().item() > 1e-5:
        assert c["error"] == py["error"] and c["digit_accuracy"] == py["digit_accuracy"], (c, py)
    # --overlay overrides the card; the other overlay makes other images, hence another loss.
    a = cpp_eval(joined, os.path.join(WORK, "cpp-eval-add"), "--overlay", "add")
    assert a["overlay"] == "add" and a["test_loss"] != c["test_loss"], (a, c)


def test_pairs_equal_the_cpp_generator_on_real_mnist():
    real = os.path.join(ROOT, "data", "mnist")
    logged = json.load(open(os.path.join(ROOT, "docs", "runs", "multimnist-full-s41.json")))["overlap"]
    if not os.path.isfile(os.path.join(real, "t10k-images-idx3-ubyte")):
        print("    (no data/mnist: the real-MNIST fingerprint is not checked)")
        return
    pairs = mm.Pairs(*gpu_train.load_split(real, "t10k"), 1001, "add")
    iou = smaller = 0.0
    valid = 0
    for start in range(0, 10000, 1000):
        _, d, _ = pairs.batch(start, 1000)
        i, s, ok = mm.box_overlap(d)
        iou, smaller, valid = iou + i.sum(), smaller + s.sum(), valid + int(ok.sum())
    assert valid == logged["examples"] == 10000, (valid, logged)
    assert abs(iou / valid - logged["mean_iou"]) < 1e-12, (iou / valid, logged)
    assert abs(smaller / valid - logged["mean_over_smaller"]) < 1e-12, (smaller / valid, logged)


def test_generator_properties():
    images = torch.randint(1, 256, (30, 28, 28), dtype=torch.uint8)
    labels = torch.arange(30) % 3
    pairs = mm.Pairs(images, labels, 5)
    x, d, y = pairs.batch(0, 60)
    assert x.shape == (60, 1, 36, 36) and d.shape == (60, 2, 1, 36, 36) and y.shape == (60, 2)
    assert (y[:, 0] != y[:, 1]).all()
    assert torch.equal(x, d.sum(1).clamp_max(1))
    a, b, dx, dy = pairs.choose(0, 60)
    assert sorted(a[:30].tolist()) == list(range(30)) and sorted(a[30:].tolist()) == list(range(30))  # one per round
    assert abs(dx).max() <= 4 and abs(dy).max() <= 4
    for k in (0, 17, 59):  # digit 0 of pair k is source a[k] at (4 + dy, 4 + dx)
        r, c = 4 + int(dy[k, 0]), 4 + int(dx[k, 0])
        assert torch.equal(d[k, 0, 0, r:r + 28, c:c + 28], images[a[k]].float() / 255)
    xb, _, yb = pairs.batch(17, 5)  # any window of the stream is the same pairs
    assert torch.equal(xb, x[17:22]) and torch.equal(yb, y[17:22])
    for n in (3, 4, 60000, 70001):  # the permutation is a bijection of [0, n)
        got = mm.permute(torch.arange(n).numpy(), n, 12345)
        assert sorted(got.tolist()) == list(range(n)), n


def test_learning_rates_equal_the_cpp_tools():
    out = os.path.join(WORK, "cpp-lr")
    cli("multimnist", "--data", data_dir(), "--out", out, "--steps", "4", "--batch-size", "4", "--lr-decay", "0.5",
        "--log-every", "1", "--test-size", "4", "--conv1-channels", "4", "--primary-types", "2", "--figure-correct",
        "0", "--figure-wrong", "0", "--no-progress", "--threads", "1")
    cpp = {r["step"]: r["lr"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "lr" in r}
    py_out = os.path.join(WORK, "py-lr")
    train(py_out, "--steps", "4", "--lr-decay", "0.5", "--log-every", "1")
    py = {r["step"]: r["lr"] for r in map(json.loads, open(os.path.join(py_out, "metrics.jsonl"))) if "lr" in r}
    assert sorted(py) == [1, 2, 3, 4] and set(py) <= set(cpp), (py, cpp)
    for step, lr in py.items():
        assert abs(lr - cpp[step]) <= 1e-12 * cpp[step], (step, lr, cpp[step])


def test_time_probe_and_final_lr():
    out = os.path.join(WORK, "probe")
    log = train(out, "--steps", "100000", "--minutes", "0.03", "--final-lr", "0.1", "--log-every", "1")
    assert "time probe:" in log, log
    start = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    steps = start["options"]["steps_planned"]
    assert 1 <= steps < 100000, start
    log_decay = start["options"]["log_lr_decay"]  # the rate ends at 0.1 x 1e-3 after the planned steps
    assert abs(math.exp(log_decay * steps * 4 / 60000) - 0.1) < 1e-9, (log_decay, steps)
    assert f"trained {steps} steps" in log, log
    lrs = [r["lr"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "lr" in r]
    assert len(lrs) == steps and lrs[0] == 1e-3, lrs  # step s trains at 1e-3 x 0.1^(s / steps)
    assert all(abs(lr - 1e-3 * 0.1 ** (s / steps)) < 1e-15 for s, lr in enumerate(lrs)), lrs


def test_errors():
    # A previous run is not replaced without --overwrite.
    log = train(os.path.join(WORK, "run"), "--steps", "1", expect_ok=False)
    assert "--overwrite" in log, log
    log = train(os.path.join(WORK, "none"), "--data", os.path.join(WORK, "missing"), "--steps", "1", expect_ok=False)
    assert "missing" in log and "Traceback" not in log, log
    # One class cannot make pairs.
    one = os.path.join(WORK, "one-class")
    write_fake_mnist(one, 20, 10)
    from test_interop import write_idx
    write_idx(os.path.join(one, "train-labels-idx1-ubyte"), torch.zeros(20, dtype=torch.uint8))
    log = trainer("--data", one, "--out", os.path.join(WORK, "one"), "--device", "cpu", "--ops-library", OPS,
                  "--steps", "1", *NARROW, expect_ok=False)
    assert "two classes" in log and "Traceback" not in log, log
    # --join: every part, from one file.
    out = os.path.join(WORK, "run")
    parts = sorted(os.path.join(out, p) for p in os.listdir(out) if p.startswith("model.part"))
    log = trainer("--join", os.path.join(WORK, "j.pt"), parts[0], expect_ok=False)
    assert "pass all of" in log, log
    other = torch.load(parts[1])  # a part of another file (here: written at another step)
    other["base"] = dict(other["base"], step=other["base"]["step"] + 1)
    torch.save(other, os.path.join(WORK, "other.part1.pt"))
    log = trainer("--join", os.path.join(WORK, "j.pt"), parts[0], os.path.join(WORK, "other.part1.pt"), *parts[2:],
                  expect_ok=False)
    assert "different files" in log, log
    log = trainer("--join", os.path.join(WORK, "j.pt"), os.path.join(out, "metrics.jsonl"), expect_ok=False)
    assert "not a weight-file part" in log, log


def main():
    global CLI, OPS, WORK
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    CLI, OPS = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        WORK = work
        write_fake_mnist(data_dir(), 56, 24)
        failed = run_tests((test_generator_properties, test_pairs_equal_the_cpp_generator_on_real_mnist,
                            test_run_is_scored_alike_by_the_cpp_tool, test_learning_rates_equal_the_cpp_tools,
                            test_time_probe_and_final_lr, test_errors))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
