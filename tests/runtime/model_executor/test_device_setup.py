"""The CUDA device a model runner makes current (``device_setup.py``): decided without a GPU."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.model_executor.device_setup import (
    cuda_device_to_make_current,
    make_device_current,
)


@pytest.mark.parametrize(("device", "current"), [
    ("cuda:1", 1),
    ("cuda:0", 0),
    ("cuda", None),  # already means the current device
    ("cpu", None),
    ("meta", None),
])
def test_a_model_on_cuda_n_makes_device_n_current_and_nothing_else_sets_one(device, current):
    assert cuda_device_to_make_current(torch.device(device)) == current


@pytest.mark.parametrize("device", ["cpu", "meta", "cuda"])
def test_devices_without_an_index_leave_cuda_untouched(device):
    """Runs without CUDA: a CPU or meta runner (or a bare ``cuda``) calls no CUDA API."""
    make_device_current(torch.device(device))


def test_the_overlap_decode_worker_thread_makes_the_models_device_current():
    """The current CUDA device is a thread's: the decode worker's thread runs its
    initializer with the runner's device (on a CPU, the call sets nothing)."""
    from radixlm.runtime.scheduler.decode_worker import DecodeWorker

    class Runner:
        device = torch.device("cpu")

    worker = DecodeWorker(Runner(), None, None, None)
    try:
        assert worker._thread._initializer is make_device_current
        assert worker._thread._initargs == (torch.device("cpu"),)
    finally:
        worker._thread.shutdown()
