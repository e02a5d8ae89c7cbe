"""Tests of radixlm/runtime/speculative/ngram_proposer.py and draft_proposer.py: the n-gram
index against a naive search, the adaptive draft length, and the proposer over a real radix
tree (tree continuations first, budgets kept, the tree left out when asked)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.radix_tree import RadixCache
from radixlm.runtime.request import Req
from radixlm.runtime.sampling.sampling_params import SamplingParams
from radixlm.runtime.speculative.draft_proposer import PROBE_EVERY, DraftLength
from radixlm.runtime.speculative.draft_tree import Draft
from radixlm.runtime.speculative.ngram_proposer import NgramIndex, NgramProposer


def naive_propose(tokens: list[int], min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """The reference: the longest suffix (min_n..max_n tokens) with an earlier occurrence,
    the latest such occurrence, and what followed it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + max_tokens]
    return []


def index_of(tokens: list[int], min_n: int = 2, max_n: int = 8) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


# NgramIndex ----------------------------------------------------------------------------------


def test_the_longest_matching_suffix_wins_over_a_later_shorter_one():
    # (1, 2, 3) occurred once, followed by 9; (2, 3) last occurred followed by 7.
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    assert index_of(tokens, 2, 8).propose(3) == [9, 5, 2]
    assert index_of(tokens, 2, 2).propose(3) == [7, 1, 2]  # max window 2: (2, 3) only


def test_the_latest_earlier_occurrence_of_the_suffix_is_followed():
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert index_of(tokens).propose(4) == [6, 1, 2]


def test_a_suffix_shorter_than_the_min_window_finds_nothing():
    tokens = [4, 1, 5, 6, 1]  # only (1,) occurred before
    assert index_of(tokens, 2, 8).propose(4) == []
    assert index_of(tokens, 1, 8).propose(4) == [5, 6, 1]


def test_nothing_found_in_a_sequence_without_repeats():
    assert index_of(list(range(3, 40))).propose(4) == []
    assert index_of([]).propose(4) == []
    assert index_of([7]).propose(4) == []


def test_a_draft_is_cut_at_max_tokens_and_at_the_sequence_end():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert index_of(tokens).propose(2) == [3, 4]
    assert index_of(tokens).propose(100) == [3, 4, 5, 6, 1, 2]


def test_the_sequence_own_suffix_is_not_its_earlier_occurrence():
    # (1, 1) ends at the last position and at the one before: the earlier one is followed.
    assert index_of([1, 1, 1]).propose(4) == [1]


@pytest.mark.parametrize(("low", "high"), [(0, 4), (3, 2), (-1, 1)])
def test_bad_windows_are_refused(low, high):
    with pytest.raises(ValueError, match="n-gram windows"):
        NgramIndex(low, high)


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40),
       cuts=st.lists(st.integers(0, 40), max_size=6),
       min_n=st.integers(1, 3), extra=st.integers(0, 4), max_tokens=st.integers(1, 6))
def test_an_index_grown_step_by_step_proposes_what_one_built_at_once_does(
        tokens, cuts, min_n, extra, max_tokens):
    max_n = min_n + extra
    grown = NgramIndex(min_n, max_n)
    start = 0
    for cut in sorted({c for c in cuts if c <= len(tokens)} | {len(tokens)}):
        grown.extend(tokens[start:cut])
        start = cut
        expected = naive_propose(tokens[:cut], min_n, max_n, max_tokens)
        assert grown.propose(max_tokens) == expected
        assert index_of(tokens[:cut], min_n, max_n).propose(max_tokens) == expected


# DraftLength ---------------------------------------------------------------------------------


def test_a_draft_length_starts_at_its_limit_and_full_acceptance_lengthens_it_to_the_limit():
    length = DraftLength(limit=6)
    assert length.next(0) == 6
    length.length = 2
    length.observe(2, 2)
    assert length.next(3) == 3
    for position in range(4, 14):
        proposed = length.next(position)
        length.observe(proposed, proposed)
    assert length.next(14) == 6  # never above the limit


def test_a_partly_accepted_draft_sets_the_length_to_one_more_than_accepted():
    length = DraftLength(limit=6)
    length.observe(6, 2)
    assert length.next(3) == 3
    length.observe(3, 1)
    assert length.next(5) == 2


def test_drafts_rejected_at_their_first_token_halve_the_length_down_to_zero():
    length = DraftLength(limit=8)
    seen, position = [], 0
    while length.length > 0:
        proposed = length.next(position)
        seen.append(proposed)
        length.observe(proposed, 0)
        position += 1
    assert seen == [8, 4, 2, 1]
    assert length.next(position) == 0 and not length.may_draft(position)


def test_an_empty_draft_changes_nothing():
    length = DraftLength(limit=4)
    length.observe(0, 0)
    assert length.next(0) == 4


def test_at_zero_a_one_token_probe_comes_every_probe_every_output_tokens():
    length = DraftLength(limit=4, length=0)
    looked_at = 0
    for round_ in range(3):
        steps = [(length.may_draft(p), length.next(p))
                 for p in range(looked_at + 1, looked_at + PROBE_EVERY + 1)]
        # may_draft says yes exactly before the probe.
        assert steps == [(False, 0)] * (PROBE_EVERY - 1) + [(True, 1)], round_
        looked_at += PROBE_EVERY
        length.observe(1, 0)  # the probe failed: still zero, the count starts again
        assert length.length == 0
    assert length.next(looked_at + 3) == 0
    assert length.next(looked_at + PROBE_EVERY + 5) == 1  # (tokens come several at a time)
    length.observe(1, 1)  # an accepted probe brings drafting back
    assert length.next(looked_at + PROBE_EVERY + 6) == 2 and length.may_draft(0)


def test_a_lookup_that_found_nothing_stops_may_draft_until_the_next_probe():
    length = DraftLength(limit=4)
    assert length.may_draft(10)
    assert length.next(10) == 4
    length.note_found(False)
    assert [length.may_draft(p) for p in (10, 11, 10 + PROBE_EVERY - 1)] == [False] * 3
    assert length.may_draft(10 + PROBE_EVERY)
    assert length.next(11) == 4  # asked anyway (a step not run ahead), it still looks up
    length.note_found(True)
    assert length.may_draft(12)


# NgramProposer over a real radix tree -------------------------------------------------------


def make_tree(page_size: int = 1) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    allocator = TokenToKVPoolAllocator(256, page_size)
    return allocator, RadixCache(allocator, page_size)


def cache(allocator: TokenToKVPoolAllocator, tree: RadixCache, key: list[int],
          extra_key: str | None = None) -> None:
    indices = allocator.alloc(len(key))
    kept = tree.insert(key, indices, extra_key)
    allocator.free(indices[:kept])


def tokens_of(drafts: list[Draft]) -> list[list[int]]:
    return [draft.tokens for draft in drafts]


def request(input_ids: list[int], output_ids: list[int] = (), extra_key: str | None = None
            ) -> Req:
    req = Req("r", list(input_ids), SamplingParams(), extra_key=extra_key)
    req.output_ids = list(output_ids)
    return req


PROMPT = [10, 11, 12, 13, 10, 11]  # its own n-gram draft: [12, 13, 10, 11]
CACHED = PROMPT + [40, 41, 42, 43, 44, 45]  # an earlier request's continuation


def test_the_tree_continuation_is_preferred_to_the_request_own_ngrams():
    allocator, tree = make_tree()
    cache(allocator, tree, CACHED)
    proposer = NgramProposer(tree, max_draft=4, min_window=2, max_window=8)
    assert tokens_of(proposer.propose([request(PROMPT)], [10])) == [[40, 41, 42, 43]]


def test_the_tree_continues_after_the_output_too():
    allocator, tree = make_tree()
    cache(allocator, tree, CACHED)
    proposer = NgramProposer(tree, max_draft=4, min_window=2, max_window=8)
    assert tokens_of(proposer.propose([request(PROMPT, [40, 41])], [10])) == [[42, 43, 44, 45]]


def test_without_a_tree_match_the_request_own_ngrams_draft():
    allocator, tree = make_tree()
    cache(allocator, tree, CACHED)
    proposer = NgramProposer(tree, max_draft=4, min_window=2, max_window=8)
    other_namespace = request(PROMPT, extra_key="tenant-b")
    diverged = request(PROMPT, [50])  # nothing cached after PROMPT + [50]
    assert tokens_of(proposer.propose([other_namespace, diverged], [10, 10])) == [
        [12, 13, 10, 11], []]


def test_a_disabled_tree_leaves_the_request_own_tokens_only():
    allocator, tree = make_tree()
    cache(allocator, tree, CACHED)
    proposer = NgramProposer(None, max_draft=4, min_window=2, max_window=8)
    assert tokens_of(proposer.propose([request(PROMPT)], [10])) == [[12, 13, 10, 11]]


def test_drafts_keep_each_request_budget_and_the_draft_limit():
    allocator, tree = make_tree()
    cache(allocator, tree, CACHED)
    proposer = NgramProposer(tree, max_draft=3, min_window=2, max_window=8)
    reqs = [request(PROMPT), request(PROMPT), request(PROMPT), request(PROMPT, [50])]
    drafts = proposer.propose(reqs, [10, 2, 0, 1])
    assert tokens_of(drafts) == [[40, 41, 42], [40, 41], [], []]
    own = NgramProposer(None, max_draft=3, min_window=2, max_window=8)
    assert tokens_of(own.propose([request(PROMPT), request(PROMPT)], [10, 1])) == [
        [12, 13, 10], [12]]


def test_the_request_index_follows_its_output_as_it_grows():
    proposer = NgramProposer(None, max_draft=4, min_window=2, max_window=8)
    req = request([1, 2, 3, 4, 5])
    assert tokens_of(proposer.propose([req], [10])) == [[]]
    req.output_ids += [9, 1, 2]
    assert tokens_of(proposer.propose([req], [10])) == [[3, 4, 5, 9]]
    req.output_ids += [3, 4, 7]
    assert tokens_of(proposer.propose([req], [10])) == [[]]
    req.output_ids += [3]  # (7, 3) new; (3,) alone is under the window
    assert tokens_of(proposer.propose([req], [10])) == [[]]
    req.output_ids += [4]  # (3, 4): latest occurrence followed by 7
    assert tokens_of(proposer.propose([req], [10])) == [[7, 3, 4]]


def test_observed_rejections_shorten_the_request_drafts():
    proposer = NgramProposer(None, max_draft=4, min_window=2, max_window=8)
    req = request(PROMPT)
    assert tokens_of(proposer.propose([req], [10])) == [[12, 13, 10, 11]]
    proposer.observe(req, 4, 0)
    assert tokens_of(proposer.propose([req], [10])) == [[12, 13]]
    proposer.observe(req, 2, 0)
    proposer.observe(req, 1, 0)
    assert tokens_of(proposer.propose([req], [10])) == [[]]
    assert not proposer.may_propose(req)


def test_a_request_whose_lookups_find_nothing_may_not_propose_until_its_next_probe():
    proposer = NgramProposer(None, max_draft=4, min_window=2, max_window=8)
    req = request(list(range(3, 20)))
    assert proposer.may_propose(req)  # (nothing looked up yet)
    assert tokens_of(proposer.propose([req], [10])) == [[]]
    assert not proposer.may_propose(req)
    req.output_ids += list(range(30, 30 + PROBE_EVERY))
    assert proposer.may_propose(req)
    req.output_ids += [3, 4]  # now (3, 4) occurred before
    assert tokens_of(proposer.propose([req], [10])) == [[5, 6, 7, 8]]
    assert proposer.may_propose(req)


def test_after_verify_ignores_hidden_states():
    proposer = NgramProposer(None, max_draft=4, min_window=2, max_window=8)
    req = request(PROMPT)
    proposer.after_verify([req], torch.zeros(3, 8), [[0, 1, 2]])
    assert tokens_of(proposer.propose([req], [10])) == [[12, 13, 10, 11]]


# Token trees (max_breadth > 1) ----------------------------------------------------------------


def test_the_index_finds_the_continuations_of_several_earlier_occurrences():
    tokens = [1, 2, 7, 8, 1, 2, 9, 9, 3, 1, 2, 5, 1, 2]
    index = NgramIndex(2, 8, keep=3)
    index.extend(tokens)
    assert index.propose_branches(2, 4) == [[5, 1], [9, 9], [7, 8]]  # latest first
    assert index.propose(2) == [5, 1]
    assert index.propose_branches(2, 1) == [[5, 1]]
    kept_one = NgramIndex(2, 8)
    kept_one.extend(tokens)
    assert kept_one.propose_branches(2, 4) == [[5, 1]]  # keep=1: the latest end only


def test_a_tree_draft_holds_the_tree_branches_then_the_request_own():
    allocator, tree = make_tree()
    cache(allocator, tree, CACHED)
    cache(allocator, tree, PROMPT + [40, 41, 60, 61])  # a fork after 40 41, now the latest
    proposer = NgramProposer(tree, max_draft=10, min_window=2, max_window=8, max_breadth=3)
    (draft,) = proposer.propose([request(PROMPT)], [10])
    # Main chain: the latest branch of the tree; then its other branch, then own n-grams,
    # filled level by level until the 10 nodes are taken.
    assert draft.tokens[: draft.main_length] == [40, 41, 60, 61]
    assert draft.tokens == [40, 41, 60, 61, 42, 43, 12, 13, 10, 11]
    assert draft.parents == [-1, 0, 1, 2, 1, 4, -1, 6, 7, 8]


def test_a_tree_is_as_deep_as_the_draft_length_and_keeps_its_node_budget():
    allocator, tree = make_tree()
    cache(allocator, tree, CACHED)
    cache(allocator, tree, PROMPT + [40, 41, 60, 61])
    proposer = NgramProposer(tree, max_draft=5, min_window=2, max_window=8, max_breadth=3)
    req = request(PROMPT)
    proposer._length(req).length = 3  # its draft length fell to three after rejections
    (draft,) = proposer.propose([req], [10])
    assert draft.tokens == [40, 41, 60, 12, 13] and max(draft.depths()) == 3
    (draft,) = proposer.propose([request(PROMPT)], [2])  # the request's budget: 2 levels
    assert draft.tokens == [40, 41, 12, 13]
