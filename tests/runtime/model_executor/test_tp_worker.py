"""A tensor-parallel rank takes rank 0's step apart (``tp_worker.step_batch``) without
reading the device: rows rewritten in place, an extend step's whole rows and a decode step's
new slots land in its request table, cut by lengths that arrive on the host."""

from __future__ import annotations

import pytest
import torch
from host_read_guard import HostReadGuard

from radixlm.host_to_device import to_device
from radixlm.kernels.forward_batch import ForwardMode
from radixlm.runtime.model_executor.tensor_parallel_ranks import Step
from radixlm.runtime.model_executor.tp_worker import step_batch
from radixlm.runtime.scheduler.scheduler_process import build_scheduler
from radixlm.runtime.server_args import ServerArgs

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def guarded_runner(tiny_model_dir):
    guard = HostReadGuard(CPU)
    path = str(tiny_model_dir())
    with guard:  # recording is off: it only marks what is made on the device
        scheduler = build_scheduler(ServerArgs(path, dtype="float32", max_total_tokens=512,
                                               num_threads=1), path)
    yield guard, scheduler.runner
    scheduler.shutdown()


def device(values: list[int]) -> torch.Tensor:
    return to_device(values, torch.int64, CPU)


def taken_apart(guard: HostReadGuard, runner, make_step):
    """``step_batch`` of the step ``make_step`` builds (its tensors made on the device under
    the guard), and what the guard recorded while the rank took it apart."""
    guard.findings.clear()
    with guard:
        step = make_step()
        guard.recording = True
        try:
            batch = step_batch(runner, step)
        finally:
            guard.recording = False
    return batch, [str(f) for f in guard.findings]


def test_an_extend_step_writes_whole_rows_and_rewritten_ones_without_a_read(guarded_runner):
    guard, runner = guarded_runner
    table = runner.req_to_token_pool.req_to_token
    rows, prefix_lens, extend_lens = [3, 1], [2, 0], [3, 4]
    slots = [[11, 12, 13, 14, 15], [21, 22, 23, 24]]
    batch, findings = taken_apart(guard, runner, lambda: Step(
        ForwardMode.EXTEND, device([5] * 7), device([2, 3, 4, 0, 1, 2, 3]),
        device([13, 14, 15, 21, 22, 23, 24]), device(rows), prefix_lens, extend_lens,
        device(slots[0] + slots[1]), [(6, device([31, 32]))]))
    assert findings == []
    assert table[3, :5].tolist() == slots[0] and table[1, :4].tolist() == slots[1]
    assert table[6, :2].tolist() == [31, 32]
    assert batch.seq_lens.tolist() == batch.seq_lens_list == [5, 4]
    assert batch.prefix_lens.tolist() == prefix_lens


def test_a_decode_step_writes_one_slot_per_request_without_a_read(guarded_runner):
    guard, runner = guarded_runner
    table = runner.req_to_token_pool.req_to_token
    _, findings = taken_apart(guard, runner, lambda: Step(
        ForwardMode.DECODE, device([7, 8]), device([5, 4]), device([41, 42]), device([3, 1]),
        [5, 4], [1, 1], device([]), []))
    assert findings == []
    assert table[3, 5].item() == 41 and table[1, 4].item() == 42
