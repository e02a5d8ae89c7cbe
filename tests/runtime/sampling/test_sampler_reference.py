"""The batched, incrementally kept sampler against a naive per-request loop of the algorithm
the runtime has always used: logit bias; repetition penalty over prompt and output, then
frequency and presence penalties over the output; the min_new_tokens ban on stop tokens
(yielding to a complete grammar); the grammar mask; then greedy argmax, or softmax at the
temperature, top-k / top-p / min-p, and inverse transform sampling (the first token whose
running sum of kept probability exceeds U times their total, one uniform U in float64)
from a generator seeded per (sampling_seed, output position).

A mixed batch runs for many steps while requests join (some with output already, as after a
retraction), leave, and get tokens appended without a draw (as jump-forward appends them):
greedy and seeded rows must give exactly the reference's tokens at every step. Logprobs
must equal the naive log-softmax.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.sampling.logprobs import token_logprobs
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_params import SamplingParams

EOS = 0
NEG_INF = float("-inf")


def seed_for_step(seed: int, step: int) -> int:
    """The generator seed of a seeded request's draw at output position ``step``."""
    return (seed * 1_000_003 + step * 7_919 + 1) % (2**63 - 1)


def reference_logits(row: torch.Tensor, req, vocab: int, backend) -> torch.Tensor:
    """One request's logits (V,) after bias, penalties, the ban and its grammar's mask."""
    params = req.sampling
    x = row[:vocab].clone()
    for token, value in (params.logit_bias or {}).items():
        x[int(token)] += value
    if params.repetition_penalty != 1.0:
        for token in set(req.input_ids) | set(req.output_ids):
            value = float(x[token])
            x[token] = value / params.repetition_penalty if value > 0 else (
                value * params.repetition_penalty)
    for token in set(req.output_ids):
        x[token] -= (params.frequency_penalty * req.output_ids.count(token)
                     + params.presence_penalty)
    complete = req.grammar is not None and req.grammar.is_completed()
    if len(req.output_ids) < params.min_new_tokens and not complete:
        for token in list(params.stop_token_ids or []) + ([] if params.ignore_eos else [EOS]):
            x[token] = NEG_INF
    if req.grammar is not None:
        bitmask = backend.allocate_bitmask(1)
        req.grammar.fill_bitmask(bitmask, 0)
        for token in range(vocab):
            if not int(bitmask[0, token // 32]) >> (token % 32) & 1:
                x[token] = NEG_INF
    return x


def reference_token(x: torch.Tensor, req) -> int | None:
    """The token a greedy or seeded request draws from processed logits ``x`` (None for an
    unseeded sampled request, whose noise depends on the batch)."""
    params = req.sampling
    if params.is_greedy:
        return int(x.argmax())
    if params.sampling_seed is None:
        return None
    probs = torch.softmax(x / max(params.temperature, 1e-6), dim=-1)
    kept = torch.zeros_like(probs)
    mass = 0.0
    for rank, token in enumerate(sorted(range(len(probs)), key=lambda t: -float(probs[t]))):
        if (params.top_k > 0 and rank >= params.top_k) or mass >= params.top_p:
            break
        kept[token] = probs[token]
        mass += float(probs[token])
    if params.min_p > 0:
        kept = kept * (kept >= kept.max() * params.min_p)
    generator = torch.Generator().manual_seed(
        seed_for_step(params.sampling_seed, len(req.output_ids)))
    uniform = float(torch.empty(1, dtype=torch.float64).uniform_(generator=generator))
    total = sum(float(p) for p in kept)  # float64, summed in token order
    target = min(uniform * total, math.nextafter(total, 0.0))
    running = 0.0
    for token, p in enumerate(kept.tolist()):
        running += p
        if running > target:
            return token
    raise AssertionError("no token reached the target")


def req(backend=None, output_ids=(), regex=None, **params):
    grammar = None
    if regex is not None:
        compiled = backend.compile(GrammarKey("regex", regex)).result()
        grammar = backend.new_matcher(compiled)
    return SimpleNamespace(sampling=SamplingParams.from_dict(params),
                           input_ids=[5, 6, 7, 5, 30, 31], output_ids=list(output_ids),
                           grammar=grammar)


def mixed_requests(backend) -> list:
    return [
        req(temperature=0.0),
        req(temperature=0.8, sampling_seed=11),
        req(temperature=1.3, sampling_seed=12, top_k=7),
        req(temperature=0.9, sampling_seed=13, top_p=0.7),
        req(temperature=1.0, sampling_seed=14, min_p=0.2, top_k=20, top_p=0.95),
        req(temperature=0.7),  # unseeded: batch-dependent noise, checked by other tests
        req(temperature=0.0, frequency_penalty=1.2, presence_penalty=0.4,
            output_ids=[40, 40, 41]),
        req(temperature=0.0, repetition_penalty=1.8, logit_bias={"30": 6.0, "31": -3.0}),
        req(temperature=0.6, sampling_seed=15, repetition_penalty=0.7, frequency_penalty=-0.5),
        # the bias makes a stop token the favourite: banned until 4 tokens are out
        req(temperature=0.0, min_new_tokens=4, stop_token_ids=[9], logit_bias={"9": 40.0}),
        req(temperature=0.9, sampling_seed=16, min_new_tokens=3, logit_bias={"0": 40.0}),
        req(backend, temperature=0.0, regex="(cat|dog) [0-9]{1,3}"),
        # EOS is the favourite as soon as the grammar is complete, min_new_tokens or not
        req(backend, temperature=1.0, sampling_seed=17, regex="(yes|no)[a-z]{0,4}",
            min_new_tokens=8, logit_bias={"0": 30.0}),
        req(temperature=0.0, min_new_tokens=2, ignore_eos=True, stop_token_ids=[12],
            logit_bias={"0": 30.0, "12": 30.0}),
        # nothing to ban: EOS is ignored and there are no stop_token_ids
        req(temperature=0.0, min_new_tokens=3, ignore_eos=True, logit_bias={"0": 30.0}),
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokens_equal_the_per_request_reference_across_steps(grammar_backend, seed):
    vocab = grammar_backend.vocab_size
    pool = mixed_requests(grammar_backend)
    joining_late = [req(temperature=0.0, output_ids=[3, 3, 50], frequency_penalty=0.9),
                    req(temperature=1.1, sampling_seed=99, output_ids=[7], top_k=4,
                        repetition_penalty=1.3)]
    sampler = Sampler(vocab, {EOS}, seed, grammar_backend=grammar_backend)
    batch = sampler.new_batch("cpu")
    batch.add(pool[:9])
    generator = torch.Generator().manual_seed(seed)
    checked = 0
    for step in range(24):
        if step == 2:
            batch.add(pool[9:])
        if step == 5:
            batch.add(joining_late)
        if step == 9:
            batch.remove([pool[2], pool[7], joining_late[0]])
        logits = torch.randn(len(batch), vocab + 3, generator=generator) * 3  # (B, V + pad)
        reqs = list(batch.reqs)
        expected_logits = [reference_logits(row, r, vocab, grammar_backend) for row, r in
                           zip(logits, reqs)]
        processed = sampler.process_logits(logits[:, :vocab].clone(), batch)
        no_grammar = [i for i, r in enumerate(reqs) if r.grammar is None]
        torch.testing.assert_close(processed[no_grammar],
                                   torch.stack(expected_logits)[no_grammar],
                                   rtol=1e-6, atol=1e-6)
        expected = [reference_token(x, r) for x, r in zip(expected_logits, reqs)]
        tokens = sampler.sample(logits, batch)
        batch.record_sampled(tokens)
        for r, token, want in zip(reqs, tokens.tolist(), expected, strict=True):
            if want is not None:
                assert token == want, (step, r.sampling)
                checked += 1
            r.output_ids.append(token)
            if r.grammar is not None:
                assert r.grammar.accept_token(token)
        if step % 4 == 3:  # tokens appended without a draw, as jump-forward appends them
            batch.record_appended(reqs[0], [9, 40])
            reqs[0].output_ids += [9, 40]
        batch.remove([r for r in reqs if r.grammar is not None and r.grammar.is_terminated()])
    assert checked > 200


def test_logprobs_equal_the_naive_log_softmax():
    torch.manual_seed(5)
    logits = torch.randn(6, 50) * 4
    ids = [3, 0, 49, 7, 7, 21]
    entries, tops = token_logprobs(logits, ids, 4, decode=str)
    for row, (entry, top) in enumerate(zip(entries, tops, strict=True)):
        naive = torch.log_softmax(logits[row], dim=-1).tolist()
        assert entry == [naive[ids[row]], ids[row], str(ids[row])]
        best = sorted(range(50), key=lambda t: -naive[t])[:4]
        assert top == [[naive[t], t, str(t)] for t in best]
