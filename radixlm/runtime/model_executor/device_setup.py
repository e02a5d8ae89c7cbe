"""Which CUDA device a process makes current, once, when its model runner starts.

torch places work that names no device index on the *current* CUDA device: the stream CUDA
graphs are captured on, Triton's kernel launches, ``torch.cuda.Event()`` (overlap's copy
event), FlashInfer's workspace, and tensors made on ``"cuda"``. All of it must land on the
GPU the model is on, so the model runner makes its device current before anything else
touches CUDA. The current device belongs to a host thread (``cudaSetDevice``): a thread
that runs CUDA work for the model (the overlap's decode worker) must call
``make_device_current`` itself when it starts. Rule:

- ``cuda:N``: device N is made current (also under tensor parallelism, where rank r of a
  node runs on ``cuda:r``);
- ``cuda`` (no index): nothing is set; it already means the current device, where all of
  the above go too;
- any other device (``cpu``, ``meta``): nothing to set.
"""

from __future__ import annotations

import torch


def cuda_device_to_make_current(device: torch.device) -> int | None:
    """The CUDA device index to make current for a model on ``device``, or None to leave the
    current device as it is. Pure: reads nothing but ``device``."""
    if device.type != "cuda" or device.index is None:
        return None
    return device.index


def make_device_current(device: torch.device) -> None:
    """Makes ``device`` the calling thread's current CUDA device where it names one (see
    the module docstring)."""
    index = cuda_device_to_make_current(device)
    if index is not None:
        torch.cuda.set_device(index)
