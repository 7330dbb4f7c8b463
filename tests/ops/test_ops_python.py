"""The fused routing and EM operators from Python: torch.ops.load_library + torch.ops.capsnet.*.

usage: python3 test_ops_python.py /path/to/libcapsnet_ops.so

Checks values and gradients against a pure-PyTorch reference of Procedure 1 (written below, independent
of the C++ code), torch.autograd.gradcheck in float64 for both gradient modes (see gradcheck_mode), and
the argument errors.
Exit status 0 when everything passes.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from pytest_lite import expect_error, run_tests  # noqa: E402

EPS = 1e-8  # inside the squash norm, as capsnet::squash


def squash(s, eps=EPS):
    n = (s * s).sum(-1, keepdim=True)
    return s * (n / (1 + n)) / torch.sqrt(n + eps)


def reference_routing(u_hat, iterations, grad_through_routing):
    """Procedure 1 of Sabour et al. 2017 per example, softmax over the parents j.
    u_hat: [B, I, J, D] -> v: [B, J, D]. grad_through_routing=False: c_ij are constants."""
    route = u_hat if grad_through_routing else u_hat.detach()
    b = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype)  # [B, I, J]
    v = None
    for t in range(iterations):
        last = t == iterations - 1
        c = torch.softmax(b, dim=2)
        s = (c.unsqueeze(-1) * (u_hat if last else route)).sum(1)  # [B, J, D]
        v = squash(s)
        if not last:
            v_route = v if grad_through_routing else v.detach()
            b = b + (route * v_route.unsqueeze(1)).sum(-1)
    return v


def predictions(u, W):
    return torch.einsum("bik,ijdk->bijd", u, W)


def rel_err(a, b):
    scale = max(b.abs().max().item(), 1e-6)
    return (a - b).abs().max().item() / scale


def inputs(B, I, J, D, Din, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, I, Din, generator=g, dtype=torch.float64).to(dtype)
    W = (torch.randn(I, J, D, Din, generator=g, dtype=torch.float64) / Din ** 0.5).to(dtype)
    R = torch.randn(B, J, D, generator=g, dtype=torch.float64).to(dtype)
    return u, W, R


def value_and_grads(fn, tensors, R):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    v = fn(*leaves)
    grads = torch.autograd.grad((v * R).sum(), leaves)
    return [v.detach()] + list(grads)


def tolerance(dtype, r):
    """Relative to the scale of the float64 oracle. float32 at r = 5 (full gradient, |u_hat| ~ 1) is
    ill-conditioned: ATen's own float32 evaluation of the oracle is off by up to 3.7e-5 there."""
    if dtype == torch.float64:
        return 1e-10
    return 1e-5 if r <= 3 else 1e-4


def test_matches_reference():
    ops = torch.ops.capsnet
    shapes = [(1, 1, 1, 1, 1), (2, 5, 3, 4, 2), (3, 7, 1, 6, 5), (11, 20, 10, 16, 8)]
    for dtype in (torch.float64, torch.float32):
        for k, shape in enumerate(shapes):
            for r in (1, 2, 3, 5):
                tol = tolerance(dtype, r)
                for full in (True, False):
                    u, W, R = inputs(*shape, dtype, seed=k * 10 + r)
                    u64, W64, R64 = u.double(), W.double(), R.double()  # the oracle runs in float64
                    fused = value_and_grads(lambda u_, W_: ops.capsule_routing(u_, W_, r, full), (u, W), R)
                    ref = value_and_grads(lambda u_, W_: reference_routing(predictions(u_, W_), r, full),
                                          (u64, W64), R64)
                    for what, a, b in zip(("v", "grad u", "grad W"), fused, ref):
                        assert a.dtype == dtype, f"{what} has dtype {a.dtype}"
                        err = rel_err(a.double(), b)
                        assert err <= tol, f"capsule_routing {what} {shape} r={r} full={full} {dtype}: {err}"
                    u_hat = predictions(u, W)
                    fused = value_and_grads(lambda x: ops.routing_from_predictions(x, r, full), (u_hat,), R)
                    ref = value_and_grads(lambda x: reference_routing(x, r, full), (u_hat.double(),), R64)
                    for what, a, b in zip(("v", "grad u_hat"), fused, ref):
                        err = rel_err(a.double(), b)
                        assert err <= tol, f"routing_from_predictions {what} {shape} r={r} full={full}: {err}"


def frozen_coupling(u_hat0, r):
    """c^(r-1) of Procedure 1 at u_hat0: softmax_j(u_hat . A), A = sum_{t<r-1} v^(t), [B, I, J]."""
    with torch.no_grad():
        A = torch.zeros(u_hat0.shape[0], u_hat0.shape[2], u_hat0.shape[3], dtype=u_hat0.dtype)
        for t in range(r - 1):
            A += reference_routing(u_hat0, t + 1, True)  # r' = t + 1 iterations return v^(t)
        return torch.softmax((u_hat0 * A.unsqueeze(1)).sum(-1), dim=2)


def gradcheck_mode(op, u_hat_of, xs, r, full):
    """gradcheck of op(*xs). With full=False the op's gradient is by design not the derivative of its
    value (c_ij are treated as constants), so the finite differences are taken of the function it is the
    derivative of, G(x) = squash(sum_i c_ij(x0) u_hat_ij(x)) with c frozen at the checked point x0:
    H(x) = op(x) - op(x).detach() + G(x).detach() has the value of G and the backward of op."""
    if full:
        return torch.autograd.gradcheck(op, xs)
    c0 = frozen_coupling(u_hat_of(*xs).detach(), r)

    def H(*x):
        v = op(*x)
        G = squash((c0.unsqueeze(-1) * u_hat_of(*x)).sum(1))
        return v - v.detach() + G.detach()

    return torch.autograd.gradcheck(H, xs)


def test_gradcheck():
    ops = torch.ops.capsnet
    for shape in ((2, 3, 2, 3, 2), (1, 4, 3, 2, 3)):
        for r in (1, 2, 3):
            for full in (True, False):
                u, W, _ = inputs(*shape, torch.float64, seed=r)
                u.requires_grad_(True)
                W.requires_grad_(True)
                assert gradcheck_mode(lambda u_, W_: ops.capsule_routing(u_, W_, r, full), predictions, (u, W), r,
                                      full), f"capsule_routing {shape} r={r} full={full}"
                u_hat = predictions(u, W).detach().requires_grad_(True)
                assert gradcheck_mode(lambda x: ops.routing_from_predictions(x, r, full), lambda x: x, (u_hat,), r,
                                      full), f"routing_from_predictions {shape} r={r} full={full}"
                # The reference itself passes the same checks (they test the semantics, not the kernel).
                assert gradcheck_mode(lambda x: reference_routing(x, r, full), lambda x: x, (u_hat,), r, full)


def test_errors():
    ops = torch.ops.capsnet
    u, W = torch.randn(2, 5, 3), torch.randn(5, 4, 6, 3)
    expect_error(lambda: ops.capsule_routing(u, torch.randn(6, 4, 6, 3), 3, True),
                         "u has I = 5 input capsules but W has I = 6")
    expect_error(lambda: ops.capsule_routing(u[0], W, 3, True), "u must be [B, I, Din]")
    expect_error(lambda: ops.capsule_routing(u, W.double(), 3, True), "same dtype")
    expect_error(lambda: ops.capsule_routing(u, W, 0, True), "iterations must be >= 1")
    expect_error(lambda: ops.routing_from_predictions(torch.randn(2, 5, 4), 3, True),
                         "u_hat must be [B, I, J, D]")
    # Double backward is not implemented and says so.
    u2, W2 = u.clone().requires_grad_(True), W.clone().requires_grad_(True)
    g, = torch.autograd.grad(ops.capsule_routing(u2, W2, 2, True).sum(), u2, create_graph=True)
    expect_error(lambda: torch.autograd.grad(g.sum(), W2), "double backward")


def test_em_ops():
    """capsnet::em_weighted_moments / em_scaled_distance against their definitions (em.h), written
    here in PyTorch; torch.autograd.gradcheck in float64."""
    ops = torch.ops.capsnet
    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        B, I, J, D = 6, 9, 4, 16
        w = torch.rand(B, I, J, generator=g, dtype=torch.float64).to(dtype)
        w = w / (w.sum(1, keepdim=True) + 1e-3)
        V = torch.randn(B, I, J, D, generator=g, dtype=torch.float64).to(dtype)
        mean, var = ops.em_weighted_moments(w, V)
        ref_mean = torch.einsum("bij,bijd->bjd", w, V)
        ref_var = torch.einsum("bij,bijd->bjd", w, (V - ref_mean[:, None]) ** 2)
        assert rel_err(mean, ref_mean) < tol and rel_err(var, ref_var) < tol, f"moments {dtype}"
        s2 = var + 0.1
        dist = ops.em_scaled_distance(V, mean, s2)
        assert rel_err(dist, ((V - mean[:, None]) ** 2 / s2[:, None]).sum(-1)) < tol, f"distance {dtype}"
    w = torch.rand(2, 3, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    V = torch.randn(2, 3, 2, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    mu = torch.randn(2, 2, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    s2 = (torch.rand(2, 2, 4, generator=g, dtype=torch.float64) + 0.3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: ops.em_weighted_moments(a, b), (w, V))
    assert torch.autograd.gradcheck(lambda a, b, c: ops.em_scaled_distance(a, b, c), (V, mu, s2))
    expect_error(lambda: ops.em_weighted_moments(w[:, :2], V), "weights must be")
    expect_error(lambda: ops.em_scaled_distance(V.float(), mu, s2), "mean must have the dtype of votes")


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    torch.ops.load_library(sys.argv[1])
    print(f"torch {torch.__version__}, loaded {sys.argv[1]}")
    return 1 if run_tests((test_matches_reference, test_gradcheck, test_errors, test_em_ops)) else 0


if __name__ == "__main__":
    sys.exit(main())
