"""The speculative-decoding options' defaults and checks (light: the CLI's parser reads them).

Option names and meanings are SGLang's where SGLang has them: ``--speculative-algorithm``,
``--speculative-num-draft-tokens`` (the tokens one request's verify pass checks, its last
token included: k draft tokens + 1), ``--speculative-num-steps`` (a draft model's steps per
verify, k), ``--speculative-eagle-topk`` (1: chains), ``--speculative-draft-model-path``,
``--speculative-ngram-max-bfs-breadth`` (an n-gram token tree's branches) and the n-gram
match windows of SGLang's earlier releases; vLLM's for turning speculation off
above a batch size (``disable_by_batch_size``).
"""

from __future__ import annotations

ALGORITHMS = ("NGRAM", "STANDALONE")
DEFAULT_NGRAM_DRAFT_TOKENS = 5
"""Tokens an n-gram request verifies per step (4 drafted + its last) when not set."""
DEFAULT_DRAFT_MODEL_STEPS = 3
"""A draft model's steps per verify when neither count is set."""
MAX_DRAFT_TOKENS = 64
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
"""Running requests above which decode steps do not speculate, when not set: where drafts
stopped paying on a CPU (``docs/engine.md``, "Speculative decoding")."""


def check_speculative_options(args) -> None:
    """Raises ``ValueError`` naming the option that is out of range or does not apply
    (``args``: the ``ServerArgs``), and fills in the defaults of an algorithm that is on."""
    algorithm = args.speculative_algorithm
    if algorithm is not None:
        algorithm = args.speculative_algorithm = str(algorithm).upper()
        if algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS} (or unset), "
                             f"got {args.speculative_algorithm!r}; EAGLE heads are not "
                             f"served yet")
    _check_int("speculative_num_draft_tokens", args.speculative_num_draft_tokens, 2,
               MAX_DRAFT_TOKENS)
    _check_int("speculative_num_steps", args.speculative_num_steps, 1, MAX_DRAFT_TOKENS - 1)
    _check_int("speculative_eagle_topk", args.speculative_eagle_topk, 1, 1,
               "(EAGLE heads are not served; n-gram token trees: "
               "speculative_ngram_max_bfs_breadth)")
    _check_int("speculative_ngram_max_bfs_breadth", args.speculative_ngram_max_bfs_breadth,
               1, MAX_DRAFT_TOKENS, required=True)
    low = args.speculative_ngram_min_match_window_size
    high = args.speculative_ngram_max_match_window_size
    _check_int("speculative_ngram_min_match_window_size", low, 1, 64, required=True)
    _check_int("speculative_ngram_max_match_window_size", high, 1, 64, required=True)
    if low > high:
        raise ValueError(f"speculative_ngram_min_match_window_size ({low}) is above "
                         f"speculative_ngram_max_match_window_size ({high})")
    _check_int("speculative_disable_by_batch_size", args.speculative_disable_by_batch_size, 1,
               None)
    if algorithm is None:
        return
    draft_path = args.speculative_draft_model_path
    if algorithm == "STANDALONE":
        if not draft_path:
            raise ValueError("speculative_algorithm STANDALONE needs "
                             "speculative_draft_model_path (a small model with the same "
                             "tokenizer)")
        if args.speculative_ngram_max_bfs_breadth != 1:
            raise ValueError("speculative_ngram_max_bfs_breadth applies to "
                             "speculative_algorithm NGRAM (a draft model drafts chains)")
        if args.tp_size > 1:
            raise ValueError("speculative_algorithm STANDALONE and tensor parallelism "
                             "(tp_size > 1) do not combine yet")
        _fill_step_counts(args)
    else:
        for name in ("speculative_draft_model_path", "speculative_num_steps"):
            if getattr(args, name) is not None:
                raise ValueError(f"{name} applies to speculative_algorithm STANDALONE, "
                                 f"not {algorithm}")
        if args.speculative_num_draft_tokens is None:
            args.speculative_num_draft_tokens = DEFAULT_NGRAM_DRAFT_TOKENS
    if args.speculative_disable_by_batch_size is None:
        args.speculative_disable_by_batch_size = DEFAULT_DISABLE_BY_BATCH_SIZE


def _fill_step_counts(args) -> None:
    """A draft model's chain: ``num_draft_tokens == num_steps + 1`` (as SGLang requires
    for ``eagle_topk`` 1); either one gives the other."""
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is None and tokens is None:
        steps = DEFAULT_DRAFT_MODEL_STEPS
    if steps is None:
        steps = tokens - 1
    if tokens is None:
        tokens = steps + 1
    if tokens != steps + 1:
        raise ValueError(f"speculative_num_draft_tokens ({tokens}) must be "
                         f"speculative_num_steps + 1 ({steps + 1}) for a draft model's chain")
    args.speculative_num_steps, args.speculative_num_draft_tokens = steps, tokens


def _check_int(name: str, value, low: int, high: int | None, why: str = "",
               required: bool = False) -> None:
    """An integer in low..high (no upper bound: None), or None where not ``required``."""
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r} {why}".rstrip())
