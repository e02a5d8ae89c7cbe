"""The speculative-decoding options' defaults and checks (light: the CLI's parser reads them).

Option names are SGLang's where SGLang has one (``--speculative-algorithm``,
``--speculative-num-draft-tokens``, the n-gram match windows of its earlier releases) and
vLLM's for turning speculation off above a batch size (``disable_by_batch_size``).
"""

from __future__ import annotations

ALGORITHMS = ("NGRAM",)
DEFAULT_DRAFT_TOKENS = 4
"""Draft tokens per request and step when ``speculative_num_draft_tokens`` is not set."""
MAX_DRAFT_TOKENS = 64
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
"""Running requests above which decode steps do not speculate, when not set: where drafts
stopped paying on a CPU (``docs/engine.md``, "Speculative decoding")."""


def check_speculative_options(args) -> None:
    """Raises ``ValueError`` naming the option that is out of range (``args``: the
    ``ServerArgs``), and fills in the defaults of an algorithm that is on."""
    algorithm = args.speculative_algorithm
    if algorithm is not None:
        algorithm = args.speculative_algorithm = str(algorithm).upper()
        if algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS} (or unset), "
                             f"got {args.speculative_algorithm!r}; draft models (STANDALONE) "
                             f"and EAGLE heads are not served yet")
    draft = args.speculative_num_draft_tokens
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, int)
                              or not 1 <= draft <= MAX_DRAFT_TOKENS):
        raise ValueError(f"speculative_num_draft_tokens must be an integer in "
                         f"1..{MAX_DRAFT_TOKENS}, got {draft!r}")
    low = args.speculative_ngram_min_match_window_size
    high = args.speculative_ngram_max_match_window_size
    for name, value in (("speculative_ngram_min_match_window_size", low),
                        ("speculative_ngram_max_match_window_size", high)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
            raise ValueError(f"{name} must be an integer in 1..64, got {value!r}")
    if low > high:
        raise ValueError(f"speculative_ngram_min_match_window_size ({low}) is above "
                         f"speculative_ngram_max_match_window_size ({high})")
    size = args.speculative_disable_by_batch_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"speculative_disable_by_batch_size must be an integer >= 1, "
                         f"got {size!r}")
    if algorithm is not None:
        if draft is None:
            args.speculative_num_draft_tokens = DEFAULT_DRAFT_TOKENS
        if size is None:
            args.speculative_disable_by_batch_size = DEFAULT_DISABLE_BY_BATCH_SIZE
