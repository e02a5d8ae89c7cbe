"""Tests of radixlm/runtime/speculative/options.py: the speculative options are checked where
``ServerArgs`` is built (the error names the option), and an algorithm that is on gets its
defaults."""

from __future__ import annotations

import pytest

from radixlm.runtime.server_args import ServerArgs
from radixlm.runtime.speculative.options import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    DEFAULT_NGRAM_DRAFT_TOKENS,
    MAX_DRAFT_TOKENS,
)


def test_speculation_is_off_by_default_and_leaves_its_counts_unset():
    args = ServerArgs()
    assert args.speculative_algorithm is None
    assert args.speculative_num_draft_tokens is None
    assert args.speculative_disable_by_batch_size is None


def test_ngram_gets_the_default_draft_length_and_batch_size_and_any_case():
    args = ServerArgs(speculative_algorithm="ngram")
    assert args.speculative_algorithm == "NGRAM"
    assert args.speculative_num_draft_tokens == DEFAULT_NGRAM_DRAFT_TOKENS
    assert args.speculative_disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=7,
                      speculative_disable_by_batch_size=1)
    assert (args.speculative_num_draft_tokens, args.speculative_disable_by_batch_size) == (7, 1)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "medusa"])
def test_an_unserved_algorithm_is_refused_by_name(algorithm):
    with pytest.raises(ValueError, match="speculative_algorithm") as err:
        ServerArgs(speculative_algorithm=algorithm)
    assert algorithm.upper() in str(err.value)


@pytest.mark.parametrize("draft", [0, 1, -1, MAX_DRAFT_TOKENS + 1, 2.5, True, "4"])
def test_a_verify_length_out_of_range_is_refused(draft):
    """(``speculative_num_draft_tokens`` counts the last token too, as SGLang's: 2 or more.)"""
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=draft)


def test_the_min_window_above_the_max_window_is_refused_naming_both():
    with pytest.raises(ValueError, match="speculative_ngram_min_match_window_size") as err:
        ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
                   speculative_ngram_max_match_window_size=3)
    assert "speculative_ngram_max_match_window_size" in str(err.value)


@pytest.mark.parametrize("name", ["speculative_ngram_min_match_window_size",
                                  "speculative_ngram_max_match_window_size"])
@pytest.mark.parametrize("value", [0, 65, 1.0, "2"])
def test_a_window_out_of_range_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        ServerArgs(speculative_algorithm="NGRAM", **{name: value})


@pytest.mark.parametrize("size", [0, -3, True, 1.5])
def test_a_disabling_batch_size_below_one_or_not_an_integer_is_refused(size):
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=size)


def test_a_window_set_to_none_is_refused_by_name():
    with pytest.raises(ValueError, match="speculative_ngram_min_match_window_size"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=None)


def test_a_draft_model_needs_its_path_and_gets_a_chain_of_steps_plus_one():
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="STANDALONE")
    args = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path="d")
    assert args.speculative_algorithm == "STANDALONE"
    assert args.speculative_num_draft_tokens == args.speculative_num_steps + 1
    args = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d",
                      speculative_num_steps=6)
    assert args.speculative_num_draft_tokens == 7
    args = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d",
                      speculative_num_draft_tokens=3)
    assert args.speculative_num_steps == 2
    with pytest.raises(ValueError, match="speculative_num_steps"):
        ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="d",
                   speculative_num_steps=2, speculative_num_draft_tokens=5)


@pytest.mark.parametrize("name", ["speculative_draft_model_path", "speculative_num_steps"])
def test_draft_model_options_are_refused_with_ngram(name):
    with pytest.raises(ValueError, match=f"{name} applies to speculative_algorithm STANDALONE"):
        ServerArgs(speculative_algorithm="NGRAM", **{name: "d" if "path" in name else 3})


def test_token_tree_drafts_are_refused():
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_eagle_topk=2)
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_eagle_topk=1)
