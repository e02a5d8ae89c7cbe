"""STANDALONE speculative decoding: a draft model's tokens, verified by the target, change
nothing in the output: greedy and seeded tokens, logprobs and finish reasons are those of the
target decoding alone, whether the draft agrees with the target almost always (the target
drafting for itself) or almost never (another random model of the same vocabulary). Every
draft slot is given back: the pool is idle after each test (``engine_for`` checks)."""

from __future__ import annotations

import pytest
from workloads import greedy, random_ids, sampled

import radixlm
from radixlm.runtime.server_args import ServerArgs

PROMPTS = [random_ids(seed, 5 + seed % 40) for seed in range(24)]


def draft_engine(engine_for, tiny_model_dir, draft_seed: int | None, **options):
    """A float32 engine over the tiny Llama drafting with itself (``draft_seed`` None) or
    with another random model of its vocabulary (seeded ``draft_seed``)."""
    draft = (tiny_model_dir() if draft_seed is None
             else tiny_model_dir(seed=draft_seed))
    return engine_for(speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=str(draft), **options)


def spec_stats(engine) -> dict:
    return engine.get_server_info()["stats"]


@pytest.mark.parametrize("draft_seed", [pytest.param(None, marks=pytest.mark.slow), 1],
                         ids=["self-draft", "random-draft"])
def test_greedy_outputs_equal_the_target_alone_and_batched(engine_for, tiny_model_dir,
                                                           draft_seed):
    plain = engine_for()
    spec = draft_engine(engine_for, tiny_model_dir, draft_seed)
    params = greedy(20)
    expected = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=params)]
    before = spec_stats(spec)
    alone = [spec.generate(input_ids=p, sampling_params=params)["output_ids"]
             for p in PROMPTS[:8]]
    batched = [o["output_ids"] for o in spec.generate(input_ids=PROMPTS, sampling_params=params)]
    assert alone == expected[:8]
    assert batched == expected
    after = spec_stats(spec)
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert after["spec_verify_steps"] > before["spec_verify_steps"] and drafted > 0
    if draft_seed is None:  # the target's own greedy tokens: nearly all accepted
        assert accepted > 0.8 * drafted
    else:  # another random model: nearly nothing accepted, and still exact
        assert accepted < 0.5 * drafted


def test_logprobs_stops_and_seeded_sampling_equal_the_target(engine_for, tiny_model_dir):
    plain = engine_for()
    spec = draft_engine(engine_for, tiny_model_dir, None)
    prompt = PROMPTS[3]
    reference = plain.generate(input_ids=prompt, sampling_params=greedy(24))["output_ids"]
    cases = [
        (greedy(24), {"return_logprob": True, "top_logprobs_num": 3}),
        ({**greedy(24), "stop_token_ids": [reference[9]]}, {}),
        (greedy(7), {}),  # the budget ends inside an accepted run
        (sampled(11, 24), {}),
        (sampled(12, 24, top_k=20, top_p=0.9, frequency_penalty=0.3), {}),
    ]
    for params, options in cases:
        want = plain.generate(input_ids=prompt, sampling_params=params, **options)
        got = spec.generate(input_ids=prompt, sampling_params=params, **options)
        assert got["output_ids"] == want["output_ids"], params
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        if options:
            got_lp = got["meta_info"]["output_token_logprobs"]
            want_lp = want["meta_info"]["output_token_logprobs"]
            assert [e[1] for e in got_lp] == [e[1] for e in want_lp] == want["output_ids"]
            assert [e[0] for e in got_lp] == pytest.approx([e[0] for e in want_lp], abs=1e-5)
            assert len(got["meta_info"]["output_top_logprobs"]) == len(want["output_ids"])
    assert spec.generate(input_ids=prompt, sampling_params=greedy(24))["meta_info"][
        "spec_verify_ct"] > 0


@pytest.mark.slow
def test_retracted_requests_still_equal_the_target(engine_for, tiny_model_dir):
    """A pool far too small for the batch: requests are retracted and recomputed (their
    draft KV too, from the start) and still produce the target's tokens."""
    plain = engine_for()
    small = dict(max_total_tokens=512, max_running_requests=32, init_new_token_ratio=0.01,
                 min_new_token_ratio=0.01, new_token_ratio_decay=0.5)
    spec = draft_engine(engine_for, tiny_model_dir, None, **small)
    prompts = [random_ids(100 + i, 30 + i % 20) for i in range(24)]
    params = greedy(40)
    expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    before = spec_stats(spec)["retractions"]
    got = [o["output_ids"] for o in spec.generate(input_ids=prompts, sampling_params=params)]
    assert got == expected
    assert spec_stats(spec)["retractions"] > before


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_model_dir):
    target = tiny_model_dir()
    other = tiny_model_dir(vocab_size=1200)
    with pytest.raises(ValueError, match="vocabulary"):
        radixlm.Engine(str(target), dtype="float32", speculative_algorithm="STANDALONE",
                       speculative_draft_model_path=str(other))


@pytest.mark.parametrize("options, named", [
    ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "d",
      "speculative_num_steps": 3, "speculative_num_draft_tokens": 6},
     "speculative_num_draft_tokens"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "d",
      "tp_size": 2}, "tensor parallelism"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3}, "speculative_num_steps"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "d"},
     "speculative_draft_model_path"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "speculative_eagle_topk"),
    ({"speculative_algorithm": "EAGLE"}, "speculative_algorithm"),
])
def test_options_that_do_not_apply_are_refused_naming_them(options, named):
    with pytest.raises(ValueError, match=named):
        ServerArgs(**options)


def test_step_counts_follow_each_other():
    args = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path="d",
                      speculative_num_draft_tokens=6)
    assert (args.speculative_algorithm, args.speculative_num_steps) == ("STANDALONE", 5)
    args = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d",
                      speculative_num_steps=2)
    assert args.speculative_num_draft_tokens == 3
