"""capsnet for Python: the fused routing operators of libcapsnet_ops.so and the CapsNet model,
loaded from a `capsnet export` weight file.

    import capsnet
    model = capsnet.load("weights.pt")          # finds libcapsnet_ops.so (see capsnet.ops.find_library)
    out = model(images)                         # images [B, 1, 28, 28] in [0, 1]
    out.lengths.argmax(1)                       # predicted classes
"""
from . import ops
from .model import CapsNet, CapsNetOutput, check_config, load, read_weights
from .ops import capsule_routing, find_library, load_library, reference_routing

__all__ = ["ops", "CapsNet", "CapsNetOutput", "check_config", "load", "read_weights", "capsule_routing",
           "find_library", "load_library", "reference_routing"]
