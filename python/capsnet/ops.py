"""Loading libcapsnet_ops.so and the routing operator, with a pure-PyTorch reference beside it.

The fused operator torch.ops.capsnet.capsule_routing(u, W, iterations, grad_through_routing) is
Procedure 1 of Sabour et al. (2017) with the prediction vectors u_hat_{j|i} = W_ij u_i computed
inside the kernel: u [B, I, Din], W [I, J, D, Din] -> v [B, J, D]. The library must have been built
against the same torch major.minor as the Python torch that loads it.
"""
import glob
import os

import torch

ENV_VAR = "CAPSNET_OPS_LIBRARY"
LIBRARY_NAME = "libcapsnet_ops.so"
EPS = 1e-8  # inside the squash norm, as capsnet::kNormEps

_loaded = None  # path of the library loaded into this process


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_library(path=None):
    """Path of libcapsnet_ops.so: `path` if given, else $CAPSNET_OPS_LIBRARY, else the newest
    build*/capsnet/ops/libcapsnet_ops.so of this source tree. Raises FileNotFoundError saying where
    it looked."""
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"capsnet ops library: no such file: {path}")
        return os.path.abspath(path)
    env = os.environ.get(ENV_VAR)
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"capsnet ops library: ${ENV_VAR} = {env}: no such file")
        return os.path.abspath(env)
    pattern = os.path.join(_repo_root(), "build*", "capsnet", "ops", LIBRARY_NAME)
    found = sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True)
    if not found:
        raise FileNotFoundError(
            f"capsnet ops library not found: pass its path, set ${ENV_VAR}, or build the target "
            f"capsnet_ops (looked for {pattern})")
    return found[0]


def load_library(path=None):
    """Loads the operators into torch.ops.capsnet once per process; returns the library's path.
    A second call with a different path is refused (the operator schemas are already registered)."""
    global _loaded
    resolved = find_library(path) if (path is not None or _loaded is None) else _loaded
    if _loaded is not None:
        if os.path.realpath(resolved) != os.path.realpath(_loaded):
            raise RuntimeError(f"capsnet ops library: {_loaded} is already loaded, cannot also load {resolved}")
        return _loaded
    try:
        torch.ops.load_library(resolved)
    except OSError as e:
        raise OSError(f"capsnet ops library {resolved} could not be loaded ({e}); it must be built against "
                      f"the same torch major.minor as this Python's torch {torch.__version__}") from e
    _loaded = resolved
    return resolved


def squash(s, dim=-1, eps=EPS):
    """Eq. 1: v = (|s|^2 / (1 + |s|^2)) s / sqrt(|s|^2 + eps) along `dim`."""
    n = (s * s).sum(dim, keepdim=True)
    return s * (n / (1 + n)) / torch.sqrt(n + eps)


def capsule_length(v, dim=-1, eps=EPS):
    """sqrt(|v|^2 + eps) along `dim`, as capsnet::capsule_length."""
    return torch.sqrt((v * v).sum(dim) + eps)


def reference_routing(u, W, iterations, grad_through_routing=True):
    """Procedure 1 per example in plain PyTorch ops (slow, obviously correct; any device).
    u: [B, I, Din], W: [I, J, D, Din] -> v: [B, J, D]. grad_through_routing=False treats the
    coupling coefficients c_ij as constants."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    u_hat = torch.einsum("bik,ijdk->bijd", u, W)  # [B, I, J, D]
    route = u_hat if grad_through_routing else u_hat.detach()
    b = torch.zeros(u_hat.shape[:3], dtype=u_hat.dtype, device=u_hat.device)  # [B, I, J]
    v = None
    for t in range(iterations):
        last = t == iterations - 1
        c = torch.softmax(b, dim=2)  # over the parents j
        v = squash((c.unsqueeze(-1) * (u_hat if last else route)).sum(1))  # [B, J, D]
        if not last:
            b = b + (route * (v if grad_through_routing else v.detach()).unsqueeze(1)).sum(-1)
    return v


def capsule_routing(u, W, iterations, grad_through_routing=True):
    """The fused operator (loads the library on first use). u: [B, I, Din], W: [I, J, D, Din] -> [B, J, D]."""
    load_library()
    return torch.ops.capsnet.capsule_routing(u, W, iterations, grad_through_routing)
