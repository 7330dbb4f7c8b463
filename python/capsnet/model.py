"""The C++ capsnet::models::CapsNet as a PyTorch nn.Module, and load() for `capsnet export` files.

Conv1 (ReLU) -> PrimaryCaps (conv, atoms-last regrouping, squash) -> DigitCaps (dynamic routing,
fused operator) -> lengths; decoder FC-ReLU-FC-ReLU-FC-sigmoid on the masked capsules.
The state_dict names equal the C++ parameter names, so an exported state dict loads unchanged.
"""
import collections
import json
import os

import torch
from torch import nn

from . import ops

FORMAT = "capsnet-weights"
VERSION = 1

# CapsNetConfig::to_json() of the C++ model with its defaults (the paper's MNIST model).
DEFAULT_CONFIG = {
    "image_channels": 1, "image_size": 28, "conv1_channels": 256, "conv1_kernel": 9,
    "primary_types": 32, "primary_dim": 8, "primary_kernel": 9, "primary_stride": 2,
    "num_classes": 10, "digit_dim": 16, "routing_iterations": 3, "grad_through_routing": True,
    "reconstruction": True, "reconstruction_scale": 0.0005, "init": "torch",
}
INITS = ("torch", "authors")


def check_config(config):
    """Returns a full config dict (defaults filled in) or raises ValueError naming the bad key.
    Keys this module does not implement (e.g. "stn") are refused unless they are off (false/null/0/"")."""
    if not isinstance(config, dict):
        raise ValueError(f"model config: expected a dict, got {type(config).__name__}")
    c = dict(DEFAULT_CONFIG)
    for key, value in config.items():
        if key not in DEFAULT_CONFIG:
            if value in (False, None, 0, "", "none"):
                continue  # a feature this module lacks, switched off: same network
            raise ValueError(f"model config: '{key}' = {value!r} is not supported by the Python CapsNet")
        default = DEFAULT_CONFIG[key]
        if key == "init" and isinstance(value, str) and value not in INITS:
            raise ValueError(f"model config: init must be one of {', '.join(INITS)}, got {value!r}")
        ok = isinstance(value, str) if isinstance(default, str) else \
            isinstance(value, bool) if isinstance(default, bool) else (
            isinstance(value, (int, float)) and not isinstance(value, bool) if isinstance(default, float) else
            isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"model config: wrong type for '{key}': {value!r}")
        c[key] = value
    for key, value in c.items():
        if key not in ("grad_through_routing", "reconstruction", "reconstruction_scale", "init") and value <= 0:
            raise ValueError(f"model config: {key} must be positive, got {value}")
    if c["image_size"] - c["conv1_kernel"] + 1 < c["primary_kernel"]:
        raise ValueError(f"model config: image_size {c['image_size']} is too small for conv1_kernel "
                         f"{c['conv1_kernel']} followed by primary_kernel {c['primary_kernel']}")
    return c


def primary_scale(c):
    """PrimaryCaps' output scale: 1 / primary_types with init "authors" (their one routing iteration), else 1."""
    return 1.0 / c["primary_types"] if c["init"] == "authors" else 1.0


def primary_grid(c):
    return (c["image_size"] - c["conv1_kernel"] + 1 - c["primary_kernel"]) // c["primary_stride"] + 1


class PrimaryCaps(nn.Module):
    """x: [B, Cin, H, W] -> u: [B, types * H' * W', dim], capsule order (type, y, x), squashed."""

    def __init__(self, in_channels, types, dim, kernel, stride, scale=1.0):
        super().__init__()
        self.types, self.dim, self.scale = types, dim, scale
        self.conv = nn.Conv2d(in_channels, types * dim, kernel, stride=stride)

    def forward(self, x):
        y = self.conv(x)  # [B, types * dim, H', W']; channel = type * dim + atom
        if self.scale != 1.0:
            y = y * self.scale
        B, _, H, W = y.shape
        # Atoms last *before* flattening; a plain view would mix neighbouring positions.
        u = y.view(B, self.types, self.dim, H, W).permute(0, 1, 3, 4, 2).reshape(B, self.types * H * W, self.dim)
        return ops.squash(u)


class CapsuleLinear(nn.Module):
    """DigitCaps: u [B, I, Din] -> v [B, J, D]; weight W [I, J, D, Din]. fused=True runs
    torch.ops.capsnet.capsule_routing (CPU: float32 / float64; CUDA, when the library was built with it:
    also float16 / bfloat16, so under autocast W is cast to the activations' dtype), otherwise
    ops.reference_routing (same math)."""

    def __init__(self, in_caps, in_dim, out_caps, out_dim, iterations, grad_through_routing, fused=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_caps, out_caps, out_dim, in_dim) * 0.01)
        self.iterations, self.grad_through_routing, self.fused = iterations, grad_through_routing, fused

    def forward(self, u):
        I, _, _, Din = self.weight.shape
        if u.dim() != 3 or u.shape[1] != I or u.shape[2] != Din:
            raise ValueError(f"CapsuleLinear: input must be [B, {I}, {Din}], got {list(u.shape)}")
        if self.fused:
            W = self.weight
            if u.dtype != W.dtype:  # autocast: half-precision activations on CUDA, the weights' dtype on CPU
                if u.is_cuda:
                    W = W.to(u.dtype)
                else:
                    u = u.to(W.dtype)
            return ops.capsule_routing(u, W, self.iterations, self.grad_through_routing)
        return ops.reference_routing(u, self.weight, self.iterations, self.grad_through_routing)


class Decoder(nn.Module):
    """masked capsules [B, J * D] -> pixels [B, out] in (0, 1)."""

    def __init__(self, in_features, out_features, hidden1=512, hidden2=1024):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden1)
        self.fc2 = nn.Linear(hidden1, hidden2)
        self.fc3 = nn.Linear(hidden2, out_features)

    def forward(self, x):
        return torch.sigmoid(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))))


CapsNetOutput = collections.namedtuple("CapsNetOutput", ["digit_caps", "lengths", "reconstruction"])


def mask(v, index):
    """Keeps capsule index[b] of each example: v [B, J, D], index [B] -> [B, J * D]."""
    keep = torch.nn.functional.one_hot(index.long(), v.shape[1]).to(v.dtype).unsqueeze(-1)
    return (v * keep).flatten(1)


class CapsNet(nn.Module):
    """The C++ CapsNet. forward(images [B, C, H, W] in [0, 1], labels [B] or None) ->
    CapsNetOutput(digit_caps [B, K, D], lengths [B, K], reconstruction [B, C*H*W] or None).
    The decoder sees the capsule of `labels` when given, else the longest one."""

    def __init__(self, config=None, fused=True):
        super().__init__()
        c = check_config(config or {})
        self.config = c
        self.conv1 = nn.Conv2d(c["image_channels"], c["conv1_channels"], c["conv1_kernel"])
        self.primary_caps = PrimaryCaps(c["conv1_channels"], c["primary_types"], c["primary_dim"],
                                        c["primary_kernel"], c["primary_stride"], primary_scale(c))
        in_caps = c["primary_types"] * primary_grid(c) ** 2
        self.digit_caps = CapsuleLinear(in_caps, c["primary_dim"], c["num_classes"], c["digit_dim"],
                                        c["routing_iterations"], c["grad_through_routing"], fused)
        pixels = c["image_channels"] * c["image_size"] ** 2
        self.decoder = Decoder(c["num_classes"] * c["digit_dim"], pixels) if c["reconstruction"] else None
        if c["init"] == "authors":
            self.init_as_authors()

    @torch.no_grad()
    def init_as_authors(self):
        """The C++ init "authors": truncated normals (Conv1 sigma 0.05, the rest 0.1), biases 0.1 (PrimaryCaps'
        after its division). Same distributions as the C++ model, not the same draws."""
        def truncated(w, std):
            nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)
        truncated(self.conv1.weight, 0.05)
        self.conv1.bias.fill_(0.1)
        truncated(self.primary_caps.conv.weight, 0.1)
        self.primary_caps.conv.bias.fill_(0.1 / self.primary_caps.scale)
        truncated(self.digit_caps.weight, 0.1)
        if self.decoder is not None:
            for fc in (self.decoder.fc1, self.decoder.fc2, self.decoder.fc3):
                truncated(fc.weight, 0.1)
                fc.bias.fill_(0.1)

    def forward(self, images, labels=None):
        c = self.config
        expected = [c["image_channels"], c["image_size"], c["image_size"]]
        if images.dim() != 4 or list(images.shape[1:]) != expected:
            raise ValueError(f"CapsNet: images must be [B, {', '.join(map(str, expected))}], got {list(images.shape)}")
        u = self.primary_caps(torch.relu(self.conv1(images)))  # [B, I, Din]
        v = self.digit_caps(u)  # [B, K, D]
        lengths = ops.capsule_length(v)  # [B, K]
        reconstruction = None
        if self.decoder is not None:
            which = labels if labels is not None else lengths.argmax(1)
            reconstruction = self.decoder(mask(v, which))
        return CapsNetOutput(v, lengths, reconstruction)


def read_weights(path):
    """torch.load of a `capsnet export` file, checked: returns the dict (format, version, config
    (JSON string), step, state_dict, and probe when exported with --probe)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"capsnet weights: no such file: {path}")
    try:
        d = torch.load(path, map_location="cpu")
    except Exception as e:
        raise ValueError(f"capsnet weights {path}: cannot be read by torch.load (corrupt or truncated?): {e}") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"capsnet weights {path}: not a capsnet weight file (written by `capsnet export`)")
    if d.get("version") != VERSION:
        raise ValueError(f"capsnet weights {path}: unsupported version {d.get('version')!r} (this reads {VERSION})")
    for key in ("config", "state_dict"):
        if key not in d:
            raise ValueError(f"capsnet weights {path}: missing '{key}'")
    return d


def load(weights_path, fused=True, ops_library=None):
    """Builds the CapsNet described by an exported file and loads its weights, strictly: every tensor
    name and shape must match (ValueError listing the differences otherwise). Returns the module in
    eval mode. fused=True loads the operator library (ops_library, $CAPSNET_OPS_LIBRARY or the build tree)."""
    d = read_weights(weights_path)
    kind = d.get("model", "capsnet")  # files written before the key hold a CapsNet
    if kind != "capsnet":
        what = {"matrix-capsnet": "matrix capsules with EM routing", "baseline-cnn": "the baseline CNN"}.get(kind, kind)
        raise ValueError(f"capsnet weights {weights_path}: holds a {kind} model ({what}); "
                         "this package builds CapsNets only (`capsnet eval` evaluates it)")
    try:
        config = json.loads(d["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"capsnet weights {weights_path}: config is not JSON: {e}") from e
    try:
        model = CapsNet(config, fused=fused)
    except ValueError as e:
        raise ValueError(f"capsnet weights {weights_path}: {e}") from e
    if fused:
        ops.load_library(ops_library)
    state = d["state_dict"]
    own = model.state_dict()
    problems = [f"missing {k} {list(v.shape)}" for k, v in own.items() if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in own]
    problems += [f"{k}: file has {list(state[k].shape)}, model expects {list(v.shape)}"
                 for k, v in own.items() if k in state and state[k].shape != v.shape]
    if problems:
        raise ValueError(f"capsnet weights {weights_path}: state dict does not match the config: " + "; ".join(problems))
    model.load_state_dict(state, strict=True)
    model.eval()
    return model
