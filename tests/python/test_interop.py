"""C++ -> Python interop: `capsnet train` a couple of steps on generated IDX data, `capsnet export`,
then the Python package (python/capsnet) loads the weights and must reproduce the C++ model.

usage: python3 test_interop.py /path/to/capsnet /path/to/libcapsnet_ops.so

Checks: the Python module's digit capsules, lengths and reconstructions equal the C++ outputs stored by
`export --probe` and the lengths printed by `capsnet predict --json`; the fused Python module equals the
pure-PyTorch reference routing in values and gradients; float64 gradcheck of a tiny model through the
fused operator; the errors (missing file, not a weight file, wrong shapes, unsupported config, CLI errors).
Exit status 0 when everything passes.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))

import torch  # noqa: E402

import capsnet  # noqa: E402
from pytest_lite import expect_error, run_tests  # noqa: E402

CLI = OPS = WORK = None


def write_idx(path, array_u8):
    """IDX file of uint8 data (magic 0x0000080N, big-endian sizes)."""
    with open(path, "wb") as f:
        f.write(struct.pack(">I", 0x0800 | array_u8.dim()))
        for n in array_u8.shape:
            f.write(struct.pack(">I", n))
        f.write(bytes(array_u8.contiguous().view(-1).tolist()))


def write_fake_mnist(directory, n_train, n_test):
    """Random 28x28 digits whose class k lights rows 2k..2k+2 (learnable, not that it matters here)."""
    os.makedirs(directory, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = torch.arange(n) % 10
        images = (torch.rand(n, 28, 28, generator=g) * 60).to(torch.uint8)
        for i in range(n):
            k = int(labels[i])
            images[i, 2 * k:2 * k + 3] = 255
        write_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte"), images)
        write_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"), labels.to(torch.uint8))


def run(*args, expect_ok=True):
    p = subprocess.run([CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if expect_ok and p.returncode != 0:
        raise AssertionError(f"capsnet {' '.join(args)} failed ({p.returncode}):\n{p.stdout}")
    if not expect_ok and p.returncode == 0:
        raise AssertionError(f"capsnet {' '.join(args)} succeeded but should have failed:\n{p.stdout}")
    return p.stdout


def close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"{what}: max |python - c++| = {err} > {tol}"
    return err


def weights_path():
    return os.path.join(WORK, "weights.pt")


def setup():
    data = os.path.join(WORK, "data")
    write_fake_mnist(data, 16, 8)
    out = run("train", "--data", data, "--steps", "2", "--batch-size", "4", "--no-eval", "--no-progress",
              "--out", os.path.join(WORK, "run"), "--threads", "1", "--seed", "3")
    assert "trained steps 0..2" in out, out
    out = run("export", "--checkpoint", os.path.join(WORK, "run", "checkpoint.pt"), "--out", weights_path(),
              "--probe", "5", "--probe-seed", "9", "--threads", "1")
    assert "step 2" in out and "8215568 parameters" in out and "probe of 5 images" in out, out


def test_file_layout():
    d = capsnet.read_weights(weights_path())
    assert d["step"] == 2 and d["version"] == 1 and d["model"] == "capsnet"
    config = json.loads(d["config"])
    assert config["image_size"] == 28 and config["routing_iterations"] == 3, config
    assert d["state_dict"]["digit_caps.weight"].shape == (1152, 10, 16, 8)
    assert sum(t.numel() for t in d["state_dict"].values()) == 8215568
    assert set(d["probe"]) == {"images", "digit_caps", "lengths", "reconstruction"}, set(d["probe"])


def test_matches_cpp():
    model = capsnet.load(weights_path(), ops_library=OPS)
    probe = capsnet.read_weights(weights_path())["probe"]
    with torch.no_grad():
        out = model(probe["images"])
    # Same ATen kernels on both sides; only the thread split of reductions may differ.
    close(out.digit_caps, probe["digit_caps"], 1e-5, "digit capsules")
    close(out.lengths, probe["lengths"], 1e-5, "lengths")
    close(out.reconstruction, probe["reconstruction"], 1e-5, "reconstructions")
    assert torch.equal(out.lengths.argmax(1), probe["lengths"].argmax(1))
    # The lengths capsnet predict prints for real IDX input (a second C++ path: load_model + forward).
    idx = os.path.join(WORK, "data", "t10k-images-idx3-ubyte")
    lines = run("predict", idx, "--checkpoint", os.path.join(WORK, "run", "checkpoint.pt"), "--limit", "4",
                "--json", "--threads", "1").strip().splitlines()
    cpp = torch.tensor([json.loads(line)["lengths"] for line in lines])
    with open(idx, "rb") as f:
        raw = f.read()[16:16 + 4 * 784]
    images = torch.tensor(list(raw), dtype=torch.float32).view(4, 1, 28, 28) / 255
    with torch.no_grad():
        py = model(images).lengths
    close(py, cpp, 1e-5, "predict --json lengths")


def test_shipped_model():
    """models/capsnet-mnist: the Python package loads the fp16 weights as fp32 and reproduces the
    probe the C++ tool stored with them."""
    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "models", "capsnet-mnist", "capsnet-mnist.pt")
    d = capsnet.read_weights(path)
    assert d["state_dict"]["digit_caps.weight"].dtype == torch.float16
    card = json.loads(d["card"])
    assert card["test_examples"] == 10000 and card["test_accuracy"] >= 0.99, card
    model = capsnet.load(path, ops_library=OPS)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        out = model(d["probe"]["images"])
    close(out.lengths, d["probe"]["lengths"], 1e-5, "shipped model lengths")
    assert torch.equal(out.lengths.argmax(1), d["probe"]["lengths"].argmax(1))


def test_authors_init():
    """`--init authors`: the PrimaryCaps division travels with the config, so Python reproduces the C++ probe;
    Python's own authors init draws the same distributions; a bad init is refused."""
    run("train", "--data", os.path.join(WORK, "data"), "--steps", "1", "--batch-size", "4", "--no-eval",
        "--no-progress", "--out", os.path.join(WORK, "run-authors"), "--threads", "1", "--seed", "3",
        "--init", "authors")
    path = os.path.join(WORK, "authors.pt")
    run("export", "--checkpoint", os.path.join(WORK, "run-authors", "checkpoint.pt"), "--out", path,
        "--probe", "3", "--probe-seed", "9", "--threads", "1")
    d = capsnet.read_weights(path)
    assert json.loads(d["config"])["init"] == "authors", d["config"]
    model = capsnet.load(path, ops_library=OPS)
    with torch.no_grad():
        out = model(d["probe"]["images"])
        close(out.lengths, d["probe"]["lengths"], 1e-5, "authors-init lengths")
        model.primary_caps.scale = 1.0  # without the division the capsules differ: the test sees it
        assert (model(d["probe"]["images"]).lengths - d["probe"]["lengths"]).abs().max() > 1e-2
    # After one Adam step of 1e-3 the weights are still close to their init: PrimaryCaps' bias near 3.2 = 0.1 * 32.
    b = d["state_dict"]["primary_caps.conv.bias"].float()
    assert (b - 3.2).abs().max() < 0.01, b
    torch.manual_seed(0)
    m = capsnet.CapsNet({"init": "authors"})
    w = m.digit_caps.weight
    assert w.abs().max() <= 0.2 and abs(w.std().item() - 0.08796) < 0.001, w.std()
    assert m.conv1.weight.abs().max() <= 0.1 and torch.all(m.decoder.fc3.bias == 0.1)
    assert torch.allclose(m.primary_caps.conv.bias * m.primary_caps.scale, torch.tensor(0.1))
    expect_error(lambda: capsnet.CapsNet({"init": "xavier"}), "init must be one of torch, authors", ValueError)
    out = run("train", "--data", os.path.join(WORK, "data"), "--init", "xavier", "--steps", "1", expect_ok=False)
    assert "--init" in out and "xavier" in out, out


def test_fused_equals_reference_with_gradients():
    fused = capsnet.load(weights_path(), ops_library=OPS)
    ref = capsnet.load(weights_path(), fused=False)
    images = capsnet.read_weights(weights_path())["probe"]["images"][:3]
    labels = torch.tensor([1, 4, 7])
    grads = []
    for m in (fused, ref):
        m.zero_grad()
        x = images.clone().requires_grad_(True)
        out = m(x, labels)
        loss = (out.lengths * torch.arange(1.0, 11.0)).sum() + out.reconstruction.pow(2).sum()
        loss.backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
        grads[-1].append(out.lengths.detach())
    names = ["images"] + [n for n, _ in fused.named_parameters()] + ["lengths"]
    for name, a, b in zip(names, grads[0], grads[1]):
        assert a is not None and torch.isfinite(a).all(), f"{name}: no or non-finite gradient"
        scale = max(b.abs().max().item(), 1e-6)
        assert (a - b).abs().max().item() <= 1e-4 * scale, f"{name}: fused vs reference differ"
    # Every parameter learns something (none cut off from the loss).
    for name, g in zip(names[1:-1], grads[0][1:-1]):
        assert g.abs().sum().item() > 0, f"{name}: zero gradient"


def test_gradcheck_tiny_float64():
    torch.manual_seed(0)
    c = {"image_size": 10, "conv1_channels": 3, "conv1_kernel": 3, "primary_types": 2, "primary_dim": 3,
         "primary_kernel": 3, "primary_stride": 2, "num_classes": 3, "digit_dim": 2}
    capsnet.load_library(OPS)
    model = capsnet.CapsNet(c).double()
    with torch.no_grad():
        model.digit_caps.weight.mul_(30)  # routing away from its near-uniform start
    x = torch.rand(2, 1, 10, 10, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 2])
    assert torch.autograd.gradcheck(lambda x_: torch.cat([o.flatten() for o in model(x_, labels)]), (x,))
    # And with respect to the routing weights W (torch.func in torch 2.x, nn.utils.stateless in 1.13).
    func = getattr(getattr(torch, "func", None), "functional_call", None) or torch.nn.utils.stateless.functional_call
    w = model.digit_caps.weight.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda w_: func(model, {"digit_caps.weight": w_}, (x.detach(), labels)).lengths,
                                    (w,))


def test_errors():
    expect_error(lambda: capsnet.load(os.path.join(WORK, "nope.pt")), "nope.pt", FileNotFoundError)
    # A training checkpoint is not a weight file.
    expect_error(lambda: capsnet.load(os.path.join(WORK, "run", "checkpoint.pt")), "checkpoint.pt", ValueError)
    garbage = os.path.join(WORK, "garbage.pt")
    with open(garbage, "wb") as f:
        f.write(b"not a zip file at all")
    expect_error(lambda: capsnet.load(garbage), "cannot be read", ValueError)
    d = capsnet.read_weights(weights_path())

    def variant(name, change):
        e = dict(d, state_dict=dict(d["state_dict"]))
        change(e)
        path = os.path.join(WORK, name)
        torch.save(e, path)
        return path

    def set_config(**kw):
        return lambda e: e.update(config=json.dumps(dict(json.loads(e["config"]), **kw)))

    wrong = variant("wrong_config.pt", set_config(primary_types=16))
    expect_error(lambda: capsnet.load(wrong, ops_library=OPS), "primary_caps.conv.weight", ValueError)
    stn = variant("stn.pt", set_config(stn=True))
    expect_error(lambda: capsnet.load(stn, ops_library=OPS), "'stn'", ValueError)
    off = variant("stn_off.pt", set_config(stn=False))  # a switched-off feature is the same network
    capsnet.load(off, ops_library=OPS)
    bad = variant("bad_value.pt", set_config(routing_iterations=0))
    expect_error(lambda: capsnet.load(bad, ops_library=OPS), "routing_iterations", ValueError)
    missing = variant("missing.pt", lambda e: e["state_dict"].pop("decoder.fc2.bias"))
    expect_error(lambda: capsnet.load(missing, ops_library=OPS), "missing decoder.fc2.bias", ValueError)
    extra = variant("extra.pt", lambda e: e["state_dict"].update({"stn.fc.weight": torch.zeros(2)}))
    expect_error(lambda: capsnet.load(extra, ops_library=OPS), "unexpected stn.fc.weight", ValueError)
    matrix = variant("matrix.pt", lambda e: e.update(model="matrix-capsnet"))  # capsnet em's network
    expect_error(lambda: capsnet.load(matrix, ops_library=OPS), "matrix-capsnet", ValueError)
    version = variant("version.pt", lambda e: e.update(version=99))
    expect_error(lambda: capsnet.load(version, ops_library=OPS), "version", ValueError)
    expect_error(lambda: capsnet.find_library(os.path.join(WORK, "libnope.so")), "libnope.so", FileNotFoundError)
    model = capsnet.load(weights_path(), ops_library=OPS)
    expect_error(lambda: model(torch.rand(2, 1, 20, 20)), "[B, 1, 28, 28]", ValueError)
    # The CLI side.
    out = run("export", "--checkpoint", os.path.join(WORK, "absent.pt"), "--out", os.path.join(WORK, "x.pt"),
              expect_ok=False)
    assert "absent.pt" in out, out
    ckpt = os.path.join(WORK, "run", "checkpoint.pt")
    out = run("export", "--checkpoint", ckpt, "--out", ckpt, expect_ok=False)
    assert "is the input" in out and "itself" in out, out  # the one outputs-over-inputs rule
    out = run("export", "--checkpoint", ckpt, "--out", WORK, expect_ok=False)
    assert "is a directory" in out, out
    assert not os.path.exists(os.path.join(WORK, "x.pt"))


def main():
    global CLI, OPS, WORK
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    CLI, OPS = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, cli {CLI}, ops {capsnet.load_library(OPS)}")
    with tempfile.TemporaryDirectory(prefix="capsnet_interop_") as work:
        WORK = work
        setup()
        failed = run_tests((test_file_layout, test_matches_cpp, test_shipped_model, test_authors_init,
                            test_fused_equals_reference_with_gradients, test_gradcheck_tiny_float64, test_errors))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
