"""TorchScript export through the Python package, run from Python and from C++.

usage: python3 test_torchscript.py /path/to/capsnet /path/to/libcapsnet_ops.so /path/to/capsnet_check_torchscript

1. `capsnet export --probe 4` the shipped MNIST model (C++ outputs on 4 probe images stored beside the weights);
2. `python3 -m capsnet.torchscript` traces it to model.ts;
3. Python: torch.jit.load(model.ts) on the probe images equals the C++ outputs; batch sizes 1 and 7 work;
4. C++: capsnet_check_torchscript loads model.ts with torch::jit::load and compares with the C++ model;
5. a process that has not loaded the op library cannot run the module, and says which op is missing.
Exit status 0 when everything passes.
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import capsnet  # noqa: E402
import capsnet.torchscript  # noqa: E402


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def main(cli, ops_library, checker):
    shipped = os.path.join(ROOT, "models", "capsnet-mnist", "capsnet-mnist.pt")
    with tempfile.TemporaryDirectory() as work:
        weights = os.path.join(work, "weights.pt")
        subprocess.run([cli, "export", "--checkpoint", shipped, "--out", weights, "--probe", "4"], check=True,
                       stdout=subprocess.DEVNULL)
        ts = os.path.join(work, "model.ts")
        r = subprocess.run([sys.executable, "-m", "capsnet.torchscript", weights, ts, ops_library],
                           cwd=work, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")),
                           capture_output=True, text=True)
        check(r.returncode == 0, f"python3 -m capsnet.torchscript failed: {r.stderr}")

        capsnet.load_library(ops_library)
        module = torch.jit.load(ts)
        probe = capsnet.read_weights(weights)["probe"]
        with torch.no_grad():
            caps, lengths, recon = module(probe["images"])
        for name, got in (("digit_caps", caps), ("lengths", lengths), ("reconstruction", recon)):
            diff = (got - probe[name]).abs().max().item()
            print(f"python torch.jit.load {name}: max |torchscript - C++| = {diff:.3g}")
            check(diff < 1e-4, f"{name} differs from the C++ model by {diff}")
        with torch.no_grad():
            for b in (1, 7):
                out = module(torch.rand(b, 1, 28, 28))
                check(out[1].shape == (b, 10), f"batch {b}: lengths shape {tuple(out[1].shape)}")

        r = subprocess.run([checker, ts, weights], capture_output=True, text=True)
        print(r.stdout, end="")
        check(r.returncode == 0, f"C++ torch::jit::load check failed: {r.stdout} {r.stderr}")

        # Without the op library the module does not run, and the error names the capsnet op.
        r = subprocess.run([sys.executable, "-c", f"import torch; torch.jit.load({ts!r})(torch.rand(1, 1, 28, 28))"],
                           capture_output=True, text=True)
        check(r.returncode != 0 and "capsnet" in r.stderr, f"expected a missing-op error, got: {r.stderr[-500:]}")
    print("python.torchscript: OK")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
