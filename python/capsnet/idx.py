"""IDX files (the MNIST format), plain or gzipped, as uint8 tensors."""
import gzip
import math
import os

import torch


def read_idx(folder, name):
    """The IDX file `name` of `folder`, or `name`.gz there, as a uint8 tensor of its shape.
    FileNotFoundError when neither exists; ValueError for a file that is not unsigned-byte IDX or whose
    length disagrees with its header (truncated)."""
    for path in (os.path.join(folder, name), os.path.join(folder, name + ".gz")):
        if os.path.isfile(path):
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rb") as f:
                data = f.read()
            if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 8:
                raise ValueError(f"{path}: not an IDX file of unsigned bytes")
            ndim = data[3]
            dims = [int.from_bytes(data[4 + 4 * k:8 + 4 * k], "big") for k in range(ndim)]
            expected = 4 + 4 * ndim + math.prod(dims)
            if len(data) != expected:
                raise ValueError(f"{path}: {len(data)} bytes, its header says {expected} (truncated?)")
            return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).view(dims)
    raise FileNotFoundError(f"{name} (or {name}.gz) not found in {folder}")
