#!/usr/bin/env python3
"""ops.cuda: the CUDA kernels of the fused operators against the CPU kernels of the same library.

For capsule_routing and routing_from_predictions (both gradient modes, 1-3 iterations) and EM's two vote
passes: values and gradients on CUDA equal the CPU op's (float64 to 1e-10; float32 to 1e-5 of the float64
answer; float16 / bfloat16 inputs to 2e-3 / 1e-2, against float64 on the same rounded inputs), float64
gradcheck on CUDA, the shapes of the MNIST (1152 -> 10x16), MultiMNIST (3200 -> 10) and 40x40 (4608 -> 10)
models, odd sizes (J or D over a warp, single capsules), batch 1 and 512, bad input refused, and the forward
enqueues on the current stream without waiting for the GPU.

Exits 77 (ctest: skipped) when torch has no CUDA device. Usage:
  python3 tests/ops/test_cuda_ops.py path/to/libcapsnet_ops.so [-k substring]
  python3 tests/ops/test_cuda_ops.py --list
CAPSNET_TEST_DEVICE=cpu runs the same comparisons CPU against CPU (a check of this script on machines
without a GPU; the half-precision and stream tests are skipped then).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from pytest_lite import expect_error, run_tests  # noqa: E402

SKIP = 77
DEVICE = os.environ.get("CAPSNET_TEST_DEVICE", "cuda")

# (name, B, I, J, D, Din)
MODEL_SHAPES = [
    ("mnist", 3, 1152, 10, 16, 8),
    ("multimnist", 2, 3200, 10, 16, 8),
    ("affnist40", 2, 4608, 10, 16, 8),
]
ODD_SHAPES = [
    ("tiny", 1, 1, 1, 1, 1),
    ("odd", 5, 37, 7, 5, 3),
    ("wide_j", 4, 65, 33, 3, 2),    # J over one warp
    ("wide_d", 2, 9, 3, 40, 5),     # J * D = 120, D over one warp
    ("single_parent", 3, 20, 1, 4, 4),
]


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)


def routing_inputs(B, I, J, D, Din, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, I, Din, generator=g, dtype=torch.float64) * 0.5
    W = torch.randn(I, J, D, Din, generator=g, dtype=torch.float64) * (1.0 / max(1, Din)) ** 0.5
    gv = torch.randn(B, J, D, generator=g, dtype=torch.float64)
    # Rounded to the tested dtype first: the float64 reference sees exactly the values the kernel sees.
    return [t.to(dtype).double() for t in (u, W, gv)]


def fused_run(u, W, gv, iterations, full, device, dtype):
    u = u.to(device=device, dtype=dtype).requires_grad_()
    W = W.to(device=device, dtype=dtype).requires_grad_()
    v = torch.ops.capsnet.capsule_routing(u, W, iterations, full)
    gu, gW = torch.autograd.grad(v, (u, W), gv.to(device=device, dtype=dtype))
    return v, gu, gW


def predictions_run(u_hat, gv, iterations, full, device, dtype):
    u_hat = u_hat.to(device=device, dtype=dtype).requires_grad_()
    v = torch.ops.capsnet.routing_from_predictions(u_hat, iterations, full)
    (g,) = torch.autograd.grad(v, (u_hat,), gv.to(device=device, dtype=dtype))
    return v, g


def check_close(what, got, ref, tol):
    for name, a, b in zip(("v", "grad 1", "grad 2"), got, ref):
        e = rel_err(a, b)
        assert e <= tol, f"{what}: {name} relative error {e:.3g} > {tol:g}"
        assert a.device.type == DEVICE, f"{what}: {name} is on {a.device}, expected {DEVICE}"


TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def dtypes():
    return [torch.float64, torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else [])


# ------------------------------------------------------------------------------------------------
# capsule_routing

def test_fused_matches_cpu_model_shapes():
    for name, B, I, J, D, Din in MODEL_SHAPES:
        for dtype in dtypes():
            u, W, gv = routing_inputs(B, I, J, D, Din, dtype, seed=I + J)
            for full in (True, False):
                ref = fused_run(u, W, gv, 3, full, "cpu", torch.float64)
                got = fused_run(u, W, gv, 3, full, DEVICE, dtype)
                assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == dtype
                check_close(f"{name} {dtype} full={full}", got, ref, TOLERANCE[dtype])


def test_fused_general_kernels_match_cpu_at_the_model_shape():
    # CAPSNET_CUDA_KERNEL=general: the general kernels where the fast ones would run (D = 16, Din = 8).
    os.environ["CAPSNET_CUDA_KERNEL"] = "general"
    try:
        for dtype in (torch.float32, torch.bfloat16) if DEVICE == "cuda" else (torch.float32,):
            u, W, gv = routing_inputs(4, 1152, 10, 16, 8, dtype, seed=21)
            for full in (True, False):
                ref = fused_run(u, W, gv, 3, full, "cpu", torch.float64)
                got = fused_run(u, W, gv, 3, full, DEVICE, dtype)
                check_close(f"general kernels {dtype} full={full}", got, ref, TOLERANCE[dtype])
    finally:
        del os.environ["CAPSNET_CUDA_KERNEL"]


def test_fused_fast_kernels_with_16_parents_and_odd_j():
    # The fast kernels' second instance (9..16 parents: 8 slots) and a half-filled last slot (J odd).
    for J in (9, 13, 16):
        for dtype in (torch.float32,) + ((torch.bfloat16,) if DEVICE == "cuda" else ()):
            u, W, gv = routing_inputs(5, 300, J, 16, 8, dtype, seed=J)
            for full in (True, False):
                ref = fused_run(u, W, gv, 3, full, "cpu", torch.float64)
                got = fused_run(u, W, gv, 3, full, DEVICE, dtype)
                check_close(f"J={J} {dtype} full={full}", got, ref, TOLERANCE[dtype])


def test_fused_matches_cpu_odd_shapes_and_iterations():
    for name, B, I, J, D, Din in ODD_SHAPES:
        for dtype in (torch.float64, torch.float32):
            u, W, gv = routing_inputs(B, I, J, D, Din, dtype, seed=B * 7 + I)
            for iterations in (1, 2, 3, 5):
                for full in (True, False):
                    ref = fused_run(u, W, gv, iterations, full, "cpu", torch.float64)
                    got = fused_run(u, W, gv, iterations, full, DEVICE, dtype)
                    check_close(f"{name} {dtype} r={iterations} full={full}", got, ref, TOLERANCE[dtype])


def test_fused_batch_1_and_512():
    for B in (1, 512):
        u, W, gv = routing_inputs(B, 1152, 10, 16, 8, torch.float32, seed=B)
        ref = fused_run(u, W, gv, 3, True, "cpu", torch.float64)
        got = fused_run(u, W, gv, 3, True, DEVICE, torch.float32)
        check_close(f"batch {B} float32", got, ref, TOLERANCE[torch.float32])
        if DEVICE == "cuda":
            got = fused_run(u.bfloat16().double(), W.bfloat16().double(), gv.bfloat16().double(), 3, True, DEVICE,
                            torch.bfloat16)
            ref = fused_run(u.bfloat16().double(), W.bfloat16().double(), gv.bfloat16().double(), 3, True, "cpu",
                            torch.float64)
            check_close(f"batch {B} bfloat16", got, ref, TOLERANCE[torch.bfloat16])


def test_fused_examples_do_not_depend_on_the_batch():
    # The same example routed alone and inside a batch of 64 gives the same values (float64, to rounding).
    u, W, gv = routing_inputs(64, 1152, 10, 16, 8, torch.float64, seed=5)
    whole = fused_run(u, W, gv, 3, True, DEVICE, torch.float64)[0]
    alone = fused_run(u[17:18], W, gv[17:18], 3, True, DEVICE, torch.float64)[0]
    assert rel_err(alone, whole[17:18]) <= 1e-13


def test_fused_matches_the_python_reference():
    # An independent check on the device itself: the plain-PyTorch Procedure 1 (python/capsnet/ops.py).
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    from capsnet import ops as pyops
    u, W, gv = routing_inputs(4, 1152, 10, 16, 8, torch.float64, seed=11)
    for full in (True, False):
        uu = u.to(DEVICE).requires_grad_()
        WW = W.to(DEVICE).requires_grad_()
        v = pyops.reference_routing(uu, WW, 3, full)
        ref = (v,) + torch.autograd.grad(v, (uu, WW), gv.to(DEVICE))
        got = fused_run(u, W, gv, 3, full, DEVICE, torch.float64)
        check_close(f"python reference full={full}", got, ref, 1e-10)


# The full gradient only: with grad_through_routing = False the coupling coefficients are held constant
# (a stop-gradient), which finite differences do not see; that mode is held to the CPU op above.
def test_fused_gradcheck_float64():
    for (B, I, J, D, Din) in ((2, 6, 3, 4, 3), (1, 5, 33, 2, 2)):
        u, W, _ = routing_inputs(B, I, J, D, Din, torch.float64, seed=3)
        u = u.to(DEVICE).requires_grad_()
        W = W.to(DEVICE).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda a, b: torch.ops.capsnet.capsule_routing(a, b, 3, True), (u, W), eps=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------------------
# routing_from_predictions

def test_predictions_match_cpu():
    shapes = [("mnist", 3, 1152, 10, 16, 8), ("odd", 5, 37, 7, 5, 3), ("wide_j", 2, 40, 33, 2, 1),
              ("tiny", 1, 1, 1, 1, 1)]
    for name, B, I, J, D, _ in shapes:
        for dtype in dtypes():
            g = torch.Generator().manual_seed(B + I)
            u_hat = (torch.randn(B, I, J, D, generator=g, dtype=torch.float64) * 0.3).to(dtype).double()
            gv = torch.randn(B, J, D, generator=g, dtype=torch.float64).to(dtype).double()
            for iterations in (1, 3):
                for full in (True, False):
                    ref = predictions_run(u_hat, gv, iterations, full, "cpu", torch.float64)
                    got = predictions_run(u_hat, gv, iterations, full, DEVICE, dtype)
                    check_close(f"predictions {name} {dtype} r={iterations} full={full}", got, ref, TOLERANCE[dtype])


def test_predictions_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    u_hat = (torch.randn(2, 7, 4, 3, generator=g, dtype=torch.float64) * 0.5).to(DEVICE).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: torch.ops.capsnet.routing_from_predictions(x, 3, True), (u_hat,), eps=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------------------
# EM vote passes

def em_inputs(B, I, J, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(B, I, J, generator=g, dtype=torch.float64)
    w = r / (r.sum(1, keepdim=True) + 0.1)
    votes = torch.randn(B, I, J, D, generator=g, dtype=torch.float64)
    mean = torch.randn(B, J, D, generator=g, dtype=torch.float64) * 0.3
    var = torch.rand(B, J, D, generator=g, dtype=torch.float64) + 0.5
    gm = torch.randn(B, J, D, generator=g, dtype=torch.float64)
    gs = torch.randn(B, J, D, generator=g, dtype=torch.float64)
    gd = torch.randn(B, I, J, generator=g, dtype=torch.float64)
    return [t.to(dtype).double() for t in (w, votes, mean, var, gm, gs, gd)]


def em_run(inputs, device, dtype):
    w, votes, mean, var, gm, gs, gd = [t.to(device=device, dtype=dtype) for t in inputs]
    w.requires_grad_()
    votes.requires_grad_()
    m, s = torch.ops.capsnet.em_weighted_moments(w, votes)
    gw, gV = torch.autograd.grad((m, s), (w, votes), (gm, gs))
    mean.requires_grad_()
    var.requires_grad_()
    votes2 = votes.detach().requires_grad_()
    dist = torch.ops.capsnet.em_scaled_distance(votes2, mean, var)
    gV2, gmean, gvar = torch.autograd.grad(dist, (votes2, mean, var), gd)
    return [m, s, gw, gV, dist, gV2, gmean, gvar]


def test_em_matches_cpu():
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
    for (B, I, J, D) in ((3, 72, 10, 16), (2, 5, 3, 4), (1, 1, 1, 1), (4, 288, 32, 16)):
        for dtype in dtypes():
            inputs = em_inputs(B, I, J, D, dtype, seed=I)
            ref = em_run(inputs, "cpu", torch.float64)
            got = em_run(inputs, DEVICE, dtype)
            names = ["mean", "variance", "grad_w", "grad_votes", "distance", "grad_votes(d)", "grad_mean",
                     "grad_var"]
            for n, a, b in zip(names, got, ref):
                e = rel_err(a, b)
                assert e <= tol[dtype], f"EM {B, I, J, D} {dtype} {n}: relative error {e:.3g} > {tol[dtype]:g}"
                assert a.dtype == dtype and a.device.type == DEVICE


def test_em_gradcheck_float64():
    w, votes, mean, var = [t.to(DEVICE) for t in em_inputs(2, 5, 3, 4, torch.float64, seed=9)[:4]]
    w.requires_grad_(), votes.requires_grad_(), mean.requires_grad_(), var.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.capsnet.em_weighted_moments(a, b), (w, votes))
    assert torch.autograd.gradcheck(lambda a, b, c: torch.ops.capsnet.em_scaled_distance(a, b, c), (votes, mean, var))


# ------------------------------------------------------------------------------------------------
# Errors, streams

def test_bad_inputs_are_refused():
    u = torch.randn(2, 6, 3, device=DEVICE)
    W = torch.randn(6, 4, 5, 3, device=DEVICE)
    op = torch.ops.capsnet.capsule_routing
    expect_error(lambda: op(u.long(), W, 3, True), "u must be float32")
    expect_error(lambda: op(u, W.double(), 3, True), "same dtype")
    expect_error(lambda: op(u, W[:5], 3, True), "input capsules")
    expect_error(lambda: op(u, W, 0, True), "iterations must be >= 1")
    if DEVICE == "cuda":
        expect_error(lambda: op(u, W.cpu(), 3, True), "same device")
    expect_error(lambda: op(u.cpu().bfloat16(), W.cpu().bfloat16(), 3, True), "CUDA tensors only")


def test_forward_is_queued_on_the_current_stream_without_waiting():
    if DEVICE != "cuda":
        return
    u, W, _ = routing_inputs(64, 1152, 10, 16, 8, torch.float32, seed=1)
    u, W = u.float().cuda(), W.float().cuda()
    ref = torch.ops.capsnet.capsule_routing(u, W, 3, True)
    torch.cuda.synchronize()
    cycles = 200_000_000
    t = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    sleep_s = time.perf_counter() - t
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.empty_like(u)
        torch.cuda._sleep(cycles)
        x.copy_(u)  # x holds u only once the side stream gets past the sleep
        t = time.perf_counter()
        v = torch.ops.capsnet.capsule_routing(x, W, 3, True)
        host_s = time.perf_counter() - t
    side.synchronize()
    assert host_s < 0.5 * sleep_s, f"the forward waited for the GPU: {host_s:.3f} s of a {sleep_s:.3f} s sleep"
    assert rel_err(v, ref) == 0.0, "the forward did not run after the side stream's copy (wrong stream?)"


# ------------------------------------------------------------------------------------------------

def main():
    if "--list" in sys.argv:  # the test names, one per line (scripts/device_check.sh runs them one by one)
        print("\n".join(n for n in sorted(globals()) if n.startswith("test_")))
        return 0
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("ops.cuda: SKIPPED (torch sees no CUDA device)")
        return SKIP
    torch.ops.load_library(sys.argv[1])
    pattern = sys.argv[sys.argv.index("-k") + 1] if "-k" in sys.argv else ""
    tests = [f for n, f in sorted(globals().items()) if n.startswith("test_") and pattern in n]
    failed = run_tests(tests)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"ops.cuda: {len(tests) - failed} of {len(tests)} passed on {where} (torch {torch.__version__})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
