"""TorchScript export of a `capsnet export` weight file: a traced inference module that C++
(`torch::jit::load`) and Python (`torch.jit.load`) run without this package, as long as the operator
library libcapsnet_ops.so is loaded in the process (its ops are what the graph calls).

    python3 -m capsnet.torchscript weights.pt model.ts        # PYTHONPATH=python, Debian's /usr/bin/python3

The module: forward(images [B, C, S, S] float in [0, 1]) -> (digit_caps [B, K, D], lengths [B, K],
reconstruction [B, C*S*S] of the longest capsule; [B, 0] without a decoder). Any batch size.
"""
import sys
import warnings

import torch
from torch import nn

from . import model as model_lib
from . import ops


class Inference(nn.Module):
    """The CapsNet in inference mode with a tuple output (TorchScript has no namedtuple of optionals)."""

    def __init__(self, capsnet):
        super().__init__()
        self.capsnet = capsnet

    def forward(self, images):
        out = self.capsnet(images)
        recon = out.reconstruction if out.reconstruction is not None else images.new_zeros(images.shape[0], 0)
        return out.digit_caps, out.lengths, recon


def to_torchscript(capsnet, batch=2):
    """Traces `capsnet` (a capsnet.CapsNet, fused routing) on a seeded random batch; checks that the traced
    module equals the eager one on another batch size, then returns it."""
    c = capsnet.config
    capsnet.eval()
    wrapper = Inference(capsnet).eval()
    gen = torch.Generator().manual_seed(0)
    example = torch.rand(batch, c["image_channels"], c["image_size"], c["image_size"], generator=gen)
    with torch.no_grad(), warnings.catch_warnings():
        # The shape guards of the eager forward become constants of the trace: that is the intent (the
        # traced module is for this config), so their TracerWarnings are noise.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(wrapper, (example,), check_trace=False)
        other = torch.rand(batch + 3, c["image_channels"], c["image_size"], c["image_size"], generator=gen)
        for got, want in zip(traced(other), wrapper(other)):
            if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                raise RuntimeError("TorchScript trace does not reproduce the eager model on another batch size")
    return traced


def export(weights_path, out_path, ops_library=None):
    """Loads a weight file, traces it and saves the TorchScript module to `out_path`. Returns out_path."""
    capsnet = model_lib.load(weights_path, fused=True, ops_library=ops_library)
    traced = to_torchscript(capsnet)
    traced.save(out_path)
    return out_path


def main(argv):
    if len(argv) not in (3, 4):
        print("usage: python3 -m capsnet.torchscript WEIGHTS.pt OUT.ts [libcapsnet_ops.so]", file=sys.stderr)
        return 2
    try:
        export(argv[1], argv[2], argv[3] if len(argv) == 4 else None)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {argv[2]} (TorchScript; load libcapsnet_ops.so before torch.jit.load / torch::jit::load)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
