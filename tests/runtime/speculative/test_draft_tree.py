"""Tests of ``Draft`` (radixlm/runtime/speculative/draft_tree.py), a draft as a chain or a
token tree in preorder, and of the verify plan's chances over a tree (``node_chances``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.speculative.draft_tree import Draft
from radixlm.runtime.speculative.verify_plan import node_chances


def paths(draft: Draft) -> set[tuple[int, ...]]:
    """Every root-to-node token sequence of ``draft``."""
    return {tuple(draft.tokens[n] for n in draft.path(node)) for node in range(len(draft))}


def assert_tree(draft: Draft) -> None:
    """The module's invariants: parents first, siblings distinct."""
    assert len(draft.tokens) == len(draft.parents)
    seen = set()
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
        assert -1 <= parent < node
        assert (parent, token) not in seen, "two siblings hold one token"
        seen.add((parent, token))


def test_a_chain_is_its_own_main_chain():
    draft = Draft.chain([7, 8, 9])
    assert draft.parents == [-1, 0, 1]
    assert draft.main_length == 3 and draft.is_chain() and draft.branch_starts() == []
    assert draft.depths() == [1, 2, 3]
    assert draft.path(2) == [0, 1, 2]
    assert draft.child(-1, 7) == 0 and draft.child(0, 8) == 1 and draft.child(0, 9) is None
    assert not Draft() and len(Draft()) == 0 and Draft().main_length == 0


def test_branches_merge_their_common_prefixes_into_a_trie_in_preorder():
    draft = Draft.from_branches([[1, 2, 3, 4], [1, 2, 5], [6, 7], [1, 8]], max_nodes=20)
    assert_tree(draft)
    # Preorder, first branch first: 1 2 3 4 | 5 (under 2) | 8 (under 1) | 6 7.
    assert draft.tokens == [1, 2, 3, 4, 5, 8, 6, 7]
    assert draft.parents == [-1, 0, 1, 2, 1, 0, -1, 6]
    assert draft.main_length == 4 and not draft.is_chain()
    assert draft.branch_starts() == [4, 5, 6]
    assert draft.depths() == [1, 2, 3, 4, 3, 2, 1, 2]
    assert draft.child(1, 5) == 4 and draft.child(-1, 6) == 6 and draft.child(1, 8) is None
    assert paths(draft) == {(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 5), (1, 8), (6,),
                            (6, 7)}


def test_the_node_budget_bounds_the_trie():
    # Level by level: 1 | 2 5 | 3 6 | (full).
    draft = Draft.from_branches([[1, 2, 3, 4], [1, 5, 6, 7]], max_nodes=5)
    assert draft.tokens == [1, 2, 3, 5, 6] and draft.parents == [-1, 0, 1, 0, 3]
    alone = Draft.from_branches([[1, 2, 3, 4, 5, 6]], max_nodes=5)  # one branch: all depth
    assert alone.tokens == [1, 2, 3, 4, 5] and alone.is_chain()
    assert Draft.from_branches([[], [3]], max_nodes=4).tokens == [3]


def test_truncating_keeps_a_tree_and_cuts_other_branches_before_the_main_chain():
    draft = Draft.from_branches([[1, 2, 3], [1, 4, 5], [6]], max_nodes=10)
    draft.truncate(4)
    assert_tree(draft)
    assert draft.tokens == [1, 2, 3, 4] and draft.main_length == 3


def test_keep_drops_the_descendants_of_a_dropped_node():
    draft = Draft.from_branches([[1, 2, 3], [1, 4, 5], [6, 7]], max_nodes=10)
    # nodes: 0:1 1:2 2:3 3:4 4:5 5:6 6:7; drop node 1 (token 2) and node 5 (token 6).
    draft.keep([True, False, True, True, True, False, True])
    assert_tree(draft)
    assert draft.tokens == [1, 4, 5] and draft.parents == [-1, 0, 1]
    assert draft.is_chain()


branch_lists = st.lists(st.lists(st.integers(0, 5), max_size=6), max_size=6)


@settings(max_examples=300, deadline=None)
@given(branch_lists, st.integers(0, 20), st.integers(0, 20))
def test_any_branches_make_a_trie_of_their_prefixes(branches, max_nodes, cut):
    draft = Draft.from_branches(branches, max_nodes)
    assert_tree(draft)
    assert len(draft) <= max_nodes
    prefixes = {tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)}
    assert paths(draft) <= prefixes
    main = tuple(draft.tokens[: draft.main_length])
    if branches and branches[0] and max_nodes:  # the first branch begins the main chain
        first = tuple(branches[0])
        assert main[: len(first)] == first[: len(main)]
        if len(branches) == 1:
            assert main == first[:max_nodes]
    chances = node_chances(draft, 0.7)
    assert all(a >= b for a, b in zip(chances, chances[1:]))
    assert all(0 <= c <= 1 for c in chances)
    before = paths(draft)
    draft.truncate(cut)
    assert_tree(draft)
    assert paths(draft) <= before


def test_a_tree_s_chances_fall_along_the_main_chain_and_are_lower_off_it():
    draft = Draft.from_branches([[1, 2, 3], [1, 4], [5]], max_nodes=10)
    chances = node_chances(draft, 0.8)
    assert chances[:3] == [0.8, 0.8 ** 2, 0.8 ** 3]
    assert chances[3] <= 0.8 * 0.2 / 2 + 1e-12  # leaves the chain at depth 2
    assert chances[4] <= 0.2 / 2 + 1e-12  # leaves it at depth 1
