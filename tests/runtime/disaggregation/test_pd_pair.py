"""A prefill server and a decode server paired as SGLang's router pairs them (the same
request, with the same ``bootstrap_*`` fields, sent to both at once): the decode server's
results equal a unified server's, exactly the prompt's KV moves, and every failure (a
missing half, an abort, mismatched pools) ends both halves with an error and frees both
pools."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pd_pairs
import pytest
import torch
from live_server import free_port
from runtime_checks import assert_engine_idle, mooncake_missing
from workloads import random_ids

import radixlm

BOOTSTRAP_PORT = free_port()
MLA_BOOTSTRAP_PORT = free_port()
SHORT_BOOTSTRAP_PORT = free_port()
PAGED_BOOTSTRAP_PORT = free_port()
MOONCAKE_BOOTSTRAP_PORTS = {"LlamaForCausalLM": free_port(), "DeepseekV2ForCausalLM": free_port()}
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SLOW = pytest.mark.slow  # engines of their own (other pools, short timeouts): CI's last stage


@pytest.fixture
def pair(engine_for):
    """(unified, prefill, decode) engines over one tiny model (``architecture``)."""

    def build(architecture: str = "LlamaForCausalLM", port: int = BOOTSTRAP_PORT,
              **decode_options):
        unified = engine_for(architecture)
        prefill = engine_for(architecture, disaggregation_mode="prefill",
                             disaggregation_bootstrap_port=port)
        decode = engine_for(architecture, disaggregation_mode="decode", **decode_options)
        return unified, prefill, decode

    return build


def paired(prefill, decode, port: int = BOOTSTRAP_PORT, room: int | None = None,
           halves: str = "both", **request):
    """``pd_pairs.paired`` with this module's bootstrap port by default."""
    return pd_pairs.paired(prefill, decode, port, room, halves, **request)


def logprob_values(entries: list) -> torch.Tensor:
    return torch.tensor([e[0] for e in entries if e[0] is not None])


def test_a_paired_request_decodes_what_a_unified_server_does(pair):
    unified, prefill, decode = pair()
    ids = random_ids(1, 40)
    request = dict(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                   logprob_start_len=0, top_logprobs_num=2)
    want = unified.generate(**request)
    first, got = paired(prefill, decode, **request)
    assert got["output_ids"] == want["output_ids"]
    meta, want_meta = got["meta_info"], want["meta_info"]
    torch.testing.assert_close(logprob_values(meta["output_token_logprobs"]),
                               logprob_values(want_meta["output_token_logprobs"]),
                               atol=1e-5, rtol=0)
    assert len(meta["output_top_logprobs"]) == len(want_meta["output_top_logprobs"])
    # The prefill half answers with the first token and the prompt logprobs (which the
    # router puts in front of the decode half's, which has none).
    assert first["output_ids"] == want["output_ids"][:1]
    assert meta["input_token_logprobs"] == []
    torch.testing.assert_close(logprob_values(first["meta_info"]["input_token_logprobs"]),
                               logprob_values(want_meta["input_token_logprobs"]),
                               atol=1e-5, rtol=0)


def test_thirty_two_mixed_requests_match_a_unified_server(pair):
    unified, prefill, decode = pair()
    shared = random_ids(2, 30)
    rng = random.Random(3)
    requests = []
    for i in range(32):
        prompt = (shared if i % 2 else []) + random_ids(10 + i, rng.randint(3, 60))
        params = {**GREEDY, "max_new_tokens": rng.randint(1, 20)}
        requests.append(dict(input_ids=prompt, sampling_params=params,
                             return_logprob=i % 3 == 0, stream=i % 5 == 0))
    want = [unified.generate(**{**r, "stream": False}) for r in requests]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda r: paired(prefill, decode, **r)[1], requests))
    for request, ours, theirs in zip(requests, got, want):
        if request["stream"]:
            ours = ours[-1]
        assert ours["output_ids"] == theirs["output_ids"]
        if request["return_logprob"]:
            torch.testing.assert_close(
                logprob_values(ours["meta_info"]["output_token_logprobs"]),
                logprob_values(theirs["meta_info"]["output_token_logprobs"]),
                atol=1e-5, rtol=0)


def test_exactly_the_prompts_kv_moves_and_the_decode_cache_serves_a_repeated_prefix(pair):
    _, prefill, decode = pair()
    decode.flush_cache()
    before_sent = prefill.get_server_info()["disaggregation"]
    before = decode.get_server_info()["disaggregation"]
    ids = random_ids(4, 50)
    paired(prefill, decode, input_ids=ids, sampling_params=GREEDY)
    after = decode.get_server_info()["disaggregation"]
    per_token = decode.get_server_info()["kv_bytes_per_token"]
    assert after["kv_tokens_received"] - before["kv_tokens_received"] == 50
    assert after["kv_bytes_received"] - before["kv_bytes_received"] == 50 * per_token
    sent = prefill.get_server_info()["disaggregation"]
    assert sent["kv_bytes_sent"] - before_sent["kv_bytes_sent"] == 50 * per_token
    # The same prompt again: the decode server holds all but its last token already.
    paired(prefill, decode, input_ids=ids, sampling_params=GREEDY)
    again = decode.get_server_info()["disaggregation"]
    assert again["decode_cached_tokens"] - after["decode_cached_tokens"] == 49
    assert again["kv_tokens_received"] - after["kv_tokens_received"] == 1


@SLOW
def test_paged_pools_pair_and_share_prefixes(engine_for):
    unified = engine_for(page_size=4)
    prefill = engine_for(page_size=4, disaggregation_mode="prefill",
                         disaggregation_bootstrap_port=PAGED_BOOTSTRAP_PORT)
    decode = engine_for(page_size=4, disaggregation_mode="decode")
    decode.flush_cache()
    shared = random_ids(14, 21)
    for i, tail in enumerate((5, 9, 3)):
        ids = shared + random_ids(15 + i, tail)
        want = unified.generate(input_ids=ids, sampling_params=GREEDY)
        _, got = paired(prefill, decode, port=PAGED_BOOTSTRAP_PORT, input_ids=ids,
                        sampling_params=GREEDY)
        assert got["output_ids"] == want["output_ids"]
    stats = decode.get_server_info()["disaggregation"]
    assert stats["decode_cached_tokens"] == 2 * 20  # the shared 21 tokens, whole pages


def test_samples_of_one_prompt_pair_by_consecutive_rooms(pair):
    unified, prefill, decode = pair()
    ids = random_ids(5, 20)
    want = unified.generate(input_ids=ids, sampling_params=GREEDY)
    _, got = paired(prefill, decode, input_ids=ids, sampling_params={**GREEDY, "n": 3})
    assert [out["output_ids"] for out in got] == [want["output_ids"]] * 3


@SLOW
@pytest.mark.parametrize("architecture", ["DeepseekV2ForCausalLM"])
def test_the_mla_latent_pool_moves_too(pair, architecture):
    unified, prefill, decode = pair(architecture, port=MLA_BOOTSTRAP_PORT)
    ids = random_ids(6, 33)
    request = dict(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    want = unified.generate(**request)
    _, got = paired(prefill, decode, port=MLA_BOOTSTRAP_PORT, **request)
    assert got["output_ids"] == want["output_ids"]
    torch.testing.assert_close(logprob_values(got["meta_info"]["output_token_logprobs"]),
                               logprob_values(want["meta_info"]["output_token_logprobs"]),
                               atol=1e-5, rtol=0)


@SLOW
@pytest.mark.skipif(mooncake_missing() is not None, reason=mooncake_missing() or "")
@pytest.mark.parametrize("architecture", sorted(MOONCAKE_BOOTSTRAP_PORTS))
def test_the_mooncake_backend_writes_the_kv_into_the_decode_pool(engine_for, architecture):
    port = MOONCAKE_BOOTSTRAP_PORTS[architecture]
    unified = engine_for(architecture)
    prefill = engine_for(architecture, disaggregation_mode="prefill",
                         disaggregation_bootstrap_port=port,
                         disaggregation_transfer_backend="mooncake")
    decode = engine_for(architecture, disaggregation_mode="decode",
                        disaggregation_transfer_backend="mooncake")
    before = decode.get_server_info()["disaggregation"]
    shared = random_ids(16, 25)
    for i, tail in enumerate((9, 4)):
        request = dict(input_ids=shared + random_ids(17 + i, tail), sampling_params=GREEDY,
                       return_logprob=True)
        want = unified.generate(**request)
        _, got = paired(prefill, decode, port=port, **request)
        assert got["output_ids"] == want["output_ids"]
        torch.testing.assert_close(
            logprob_values(got["meta_info"]["output_token_logprobs"]),
            logprob_values(want["meta_info"]["output_token_logprobs"]), atol=1e-5, rtol=0)
    after = decode.get_server_info()["disaggregation"]
    assert after["kv_tokens_received"] - before["kv_tokens_received"] == 34 + 4
    assert after["decode_cached_tokens"] - before["decode_cached_tokens"] == 25


def test_the_fake_bootstrap_host_moves_nothing_and_still_answers(pair):
    unified, prefill, decode = pair()
    ids = random_ids(7, 10)
    want = unified.generate(input_ids=ids, sampling_params=GREEDY)
    fake = dict(bootstrap_host="2.2.2.2", bootstrap_room=0, input_ids=ids,
                sampling_params=GREEDY)
    assert decode.generate(**fake)["output_ids"] == want["output_ids"]
    assert prefill.generate(**fake)["output_ids"] == want["output_ids"][:1]


def test_a_room_in_use_fails_a_second_request_and_spares_the_first(pair):
    unified, prefill, decode = pair()
    ids = random_ids(16, 12)
    fields = dict(input_ids=ids, sampling_params=GREEDY, bootstrap_host="127.0.0.1",
                  bootstrap_port=BOOTSTRAP_PORT, bootstrap_room=random.randrange(2**63))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(decode.generate, **fields)
        time.sleep(0.3)  # waiting for its prefill half
        second = decode.generate(**fields)
        assert "bootstrap_room" in second["meta_info"]["finish_reason"]["message"]
        assert "already in use" in second["meta_info"]["finish_reason"]["message"]
        prefill.generate(**fields)
        assert first.result(timeout=30)["output_ids"] == unified.generate(
            input_ids=ids, sampling_params=GREEDY)["output_ids"]


# Faults ----------------------------------------------------------------------------------

SHORT = dict(port=SHORT_BOOTSTRAP_PORT)


@pytest.fixture
def short_pair(engine_for):
    """A pair whose halves wait 2 s for each other."""
    prefill = engine_for(disaggregation_mode="prefill", disaggregation_timeout=2.0,
                         disaggregation_bootstrap_port=SHORT_BOOTSTRAP_PORT)
    decode = engine_for(disaggregation_mode="decode", disaggregation_timeout=2.0)
    return prefill, decode


@SLOW
@pytest.mark.parametrize("halves", ["prefill", "decode"])
def test_a_half_whose_other_half_never_comes_fails_and_frees_its_kv(short_pair, halves):
    prefill, decode = short_pair
    started = time.monotonic()
    out = paired(prefill, decode, halves=halves, input_ids=random_ids(8, 30),
                 sampling_params=GREEDY, **SHORT)
    assert time.monotonic() - started < 10
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "KV transfer failed" in reason["message"]
    assert "within 2.0 s" in reason["message"]
    for engine in short_pair:
        assert_engine_idle(engine)
    # Both still serve a whole pair.
    _, got = paired(prefill, decode, input_ids=random_ids(9, 10), sampling_params=GREEDY,
                    **SHORT)
    assert len(got["output_ids"]) == GREEDY["max_new_tokens"]


@SLOW
def test_an_aborted_decode_half_frees_the_prefill_halfs_kv_at_once(short_pair):
    prefill, decode = short_pair
    room = random.randrange(2**63)
    rid = f"abort-me-{room}"
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(decode.generate, input_ids=random_ids(10, 30),
                              sampling_params={**GREEDY, "max_new_tokens": 200},
                              bootstrap_host="127.0.0.1", bootstrap_port=SHORT_BOOTSTRAP_PORT,
                              bootstrap_room=room, rid=rid)
        time.sleep(0.3)  # the decode half waits for its prefill half (never sent)
        decode.abort(rid)
        out = waiting.result(timeout=10)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    # The prefill half, sent late, learns of the cancel and fails at once, not after 2 s.
    started = time.monotonic()
    first = prefill.generate(input_ids=random_ids(10, 30), sampling_params=GREEDY,
                             bootstrap_host="127.0.0.1", bootstrap_port=SHORT_BOOTSTRAP_PORT,
                             bootstrap_room=room)
    reason = first["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "the decode server cancelled" in reason["message"]
    assert time.monotonic() - started < 2.0
    for engine in short_pair:
        assert_engine_idle(engine)


@SLOW
def test_an_aborted_prefill_half_fails_its_decode_half_at_once(short_pair):
    prefill, decode = short_pair
    room = random.randrange(2**63)
    rid = f"abort-prefill-{room}"
    fields = dict(bootstrap_host="127.0.0.1", bootstrap_port=SHORT_BOOTSTRAP_PORT,
                  bootstrap_room=room)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(prefill.generate, input_ids=random_ids(13, 40),
                            sampling_params=GREEDY, rid=rid, **fields)
        time.sleep(0.3)  # prefilled, it holds its KV for a decode half that has not asked
        prefill.abort(rid)
        first = first.result(timeout=10)
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    started = time.monotonic()
    got = decode.generate(input_ids=random_ids(13, 40), sampling_params=GREEDY, **fields)
    reason = got["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "the prefill half was aborted" in reason["message"]
    assert time.monotonic() - started < 2.0
    for engine in short_pair:
        assert_engine_idle(engine)


@SLOW
def test_pools_of_different_page_sizes_refuse_to_pair(pair):
    _, prefill, decode = pair(page_size=4)
    first, got = paired(prefill, decode, input_ids=random_ids(11, 20), sampling_params=GREEDY)
    for out in (first, got):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert "page sizes differ: prefill 1, decode 4" in reason["message"]
    for engine in (prefill, decode):
        assert_engine_idle(engine)


def test_bootstrap_fields_on_a_unified_server_are_refused(engine_for):
    with pytest.raises(ValueError, match="disaggregation-mode null"):
        engine_for().generate(input_ids=[1, 2, 3], bootstrap_host="127.0.0.1",
                              bootstrap_room=5)


def test_a_bad_room_is_refused_by_name(pair):
    _, _, decode = pair()
    with pytest.raises(ValueError, match="bootstrap_room"):
        decode.generate(input_ids=[1, 2, 3], bootstrap_host="127.0.0.1", bootstrap_room=-1)


@SLOW
def test_a_prefill_server_killed_while_its_decode_half_waits_fails_that_half(
        short_pair, tiny_model_dir):
    _, decode = short_pair
    port = free_port()
    doomed = radixlm.Engine(str(tiny_model_dir()), dtype="float32", max_total_tokens=4096,
                            disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    try:
        room = random.randrange(2**63)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(decode.generate, input_ids=random_ids(12, 30),
                                  sampling_params=GREEDY, bootstrap_host="127.0.0.1",
                                  bootstrap_port=port, bootstrap_room=room)
            time.sleep(0.5)  # the decode half has found the prefill server and asked it
            doomed._runtime.processes["scheduler"].kill()
            out = waiting.result(timeout=10)
    finally:
        doomed.shutdown()
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "no KV came from the prefill server" in reason["message"]
    assert_engine_idle(decode)


@SLOW
def test_each_kv_transfer_failure_is_logged_with_its_request_room_and_peer(
        tiny_model_dir, capfd):
    """Both halves log their failure (engines started here, so their processes write to
    the captured stderr)."""
    port = free_port()
    options = dict(dtype="float32", max_total_tokens=4096, disaggregation_timeout=1.0)
    prefill = radixlm.Engine(str(tiny_model_dir()), disaggregation_mode="prefill",
                             disaggregation_bootstrap_port=port, **options)
    decode = radixlm.Engine(str(tiny_model_dir()), disaggregation_mode="decode", **options)
    try:
        rooms = {"prefill": random.randrange(2**63), "decode": random.randrange(2**63)}
        for halves, room in rooms.items():
            paired(prefill, decode, port=port, room=room, halves=halves,
                   input_ids=random_ids(14, 20), sampling_params=GREEDY, rid=f"lone-{halves}")
        err = capfd.readouterr().err
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert (f"KV transfer failed: request lone-prefill, bootstrap_room {rooms['prefill']} "
            "(to its decode server)") in err, err
    assert (f"KV transfer failed: request lone-decode, bootstrap_room {rooms['decode']}, "
            f"prefill server 127.0.0.1:{port}") in err, err


@pytest.mark.slow  # (two servers: the tiers' own tests run in the default stage)
def test_a_decode_server_with_host_tiers_loads_an_evicted_prefix_back(engine_for):
    """A decode server with the hierarchical cache: a prompt evicted from its small pool by
    later ones comes back from its host tier when asked again (only the last token's KV
    crosses), and both answers are a unified server's."""
    port = free_port()
    unified = engine_for()
    prefill = engine_for(disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    decode = engine_for(disaggregation_mode="decode", enable_hierarchical_cache=True,
                        hicache_block_tokens=8, max_total_tokens=256)
    first = random_ids(70, 64)
    others = [random_ids(71 + i, 60) for i in range(6)]  # 360 tokens: more than the pool
    want = unified.generate(input_ids=first, sampling_params=GREEDY)["output_ids"]
    for prompt in [first, *others]:
        _, got = paired(prefill, decode, port, input_ids=prompt, sampling_params=GREEDY)
        assert not isinstance(got, BaseException), got
    before = decode.get_server_info()
    _, again = paired(prefill, decode, port, input_ids=first, sampling_params=GREEDY)
    after = decode.get_server_info()
    assert again["output_ids"] == want
    tiers = after["hierarchical_cache"]
    assert tiers["host_hit_tokens"] > before["hierarchical_cache"]["host_hit_tokens"], tiers
    received = (after["disaggregation"]["kv_tokens_received"]
                - before["disaggregation"]["kv_tokens_received"])
    assert received < 64, received  # (the blocks it held came from its own host tier)
    assert_engine_idle(prefill)
    assert_engine_idle(decode)
