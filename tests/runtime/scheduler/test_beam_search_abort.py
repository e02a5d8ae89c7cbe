"""Aborting a beam search ends it whole, wherever it is (waiting for its members, prefilling,
decoding), from any member's rid; the pool is idle afterwards, and a member arriving after
its search ended is refused, not run. (Through the Engine's processes: test_beam_groups.)"""

from __future__ import annotations

import pytest
from beam_reference import beam
from runtime_checks import assert_pool_idle, beam_reqs
from workloads import random_ids

from radixlm.runtime import messages as wire
from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.scheduler.scheduler_process import make_req

LONG = dict(ignore_eos=True)


@pytest.mark.parametrize("page_size,chunked_prefill_size", [(1, None), (4, 16)])
@pytest.mark.parametrize("steps_before", [0, 1, 6])
def test_aborting_one_member_ends_every_member_and_frees_everything(
    scheduler_for, page_size, chunked_prefill_size, steps_before
):
    """Aborted before its first step, during its chunked prefill, or while decoding: all
    four members end with the abort, and nothing stays allocated or locked."""
    scheduler = scheduler_for(page_size=page_size, chunked_prefill_size=chunked_prefill_size)
    reqs = beam_reqs(scheduler, random_ids(1200, 45), beam(4, 40, **LONG))
    for req in reqs:
        scheduler.add_request(req)
    for _ in range(steps_before):
        scheduler.step()
    assert not any(r.finished for r in reqs)
    scheduler.abort(reqs[2], "stopped by the test")
    assert all(r.finish_reason == {"type": "abort", "message": "stopped by the test"}
               for r in reqs)
    state = scheduler.state
    assert not state.running and not state.waiting and state.chunked is None
    assert_pool_idle(scheduler.server_info())


def test_a_search_waits_for_its_members_and_a_late_one_is_refused(scheduler_for):
    """The leader alone is not admitted (its members' rows would be missing); once it is
    aborted, a member naming it is refused where messages become requests."""
    scheduler = scheduler_for()
    leader, *others = beam_reqs(scheduler, random_ids(1201, 20), beam(3, 8))
    scheduler.add_request(leader)
    for _ in range(3):
        scheduler.step()
    assert leader.req_pool_idx is None and not leader.output_ids
    scheduler.abort(leader)
    assert leader.finished and not scheduler.state.waiting
    late = wire.GenerateReq("late-1", leader.input_ids, SamplingParams.from_dict(beam(3, 8)),
                          prefill_leader=leader.rid)
    with pytest.raises(ValueError, match="no beam search"):
        make_req(late, scheduler.sampling_step.tokenizer, {})  # (the loop forgot it)
    straggler = make_req(late, scheduler.sampling_step.tokenizer, {leader.rid: leader})
    scheduler.add_request(straggler)
    assert straggler.finish_reason["type"] == "abort"
    assert straggler in scheduler.step()  # reported at the next step
    assert_pool_idle(scheduler.server_info())
