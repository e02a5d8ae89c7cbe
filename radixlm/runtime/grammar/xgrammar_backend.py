"""The grammar backend on xgrammar (https://github.com/mlc-ai/xgrammar).

xgrammar compiles a grammar against a tokenizer's vocabulary, precomputing which tokens
each grammar position accepts, so a request's mask is filled in microseconds per step.

JSON schemas compile without free whitespace (``any_whitespace=False``): objects print as
``{"key": value, ...}``, which leaves a small model no room to wander in whitespace and
makes keys, colons and separators forced text for jump-forward decoding.

``check_constraint`` parses a constraint without the tokenizer (fast, cached), so bad input
is refused where it enters, in the caller's process, before anything is queued.

xgrammar 0.2.9 compiles a string with ``minLength`` / ``maxLength`` (and no pattern) to any
characters but quote, backslash and newlines, so raw control characters, which JSON does
not allow in strings, get through (the output then fails ``json.loads``), and so do invalid
UTF-8 sequences (which break ``maxLength`` once decoded). Such strings are compiled as a
pattern of printable ASCII with the same bounds instead (``harden_json_schema``): a subset
of what the schema allows, so every output still validates.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import threading
from typing import Any

import torch

from radixlm.runtime.grammar.constraints import CONSTRAINT_KINDS, GrammarKey
from radixlm.runtime.grammar.grammar_backend import GrammarBackend, GrammarMatcher

logger = logging.getLogger(__name__)

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def describe_error(err: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return _LOCATION.sub("", first)


_PLAIN_CHARACTER = "[ !#-\\[\\]-~]"
"""A length-bounded string's character: printable ASCII but quote and backslash (a valid
subset: no escapes, no other characters). Not xgrammar's ``[^"\\]`` style: it matches
byte-wise and lets invalid UTF-8 (surrogates, overlong forms) through, which decodes to
several U+FFFD and breaks ``maxLength``. Not the ranges of all valid code points either:
correct, but it makes mask fills 10-100x slower inside such strings (p99 3.7 ms against
27 us on the default model's vocabulary)."""


def harden_json_schema(schema: Any) -> Any:
    """``schema`` with every length-bounded plain string given as a pattern (see above)."""
    if isinstance(schema, list):
        return [harden_json_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    hardened = {key: harden_json_schema(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    plain = not any(key in schema for key in ("pattern", "format", "enum", "const"))
    if schema.get("type") == "string" and bounded and plain:
        low = hardened.pop("minLength", 0)
        high = hardened.pop("maxLength", "")
        hardened["pattern"] = f"^{_PLAIN_CHARACTER}{{{low},{high}}}$"
    return hardened


def _json_schema_text(text: str) -> str:
    """The schema as xgrammar should compile it; ``ValueError`` if it is not a schema."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"json_schema is not valid JSON: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (a schema), got "
                         f"{type(schema).__name__}")
    return json.dumps(harden_json_schema(schema))


@functools.lru_cache(maxsize=4096)
def check_constraint(kind: str, text: str) -> None:
    """Raises ``ValueError`` naming the field and the problem if ``text`` is not a valid
    ``kind`` (regex, json_schema or ebnf); a valid one passes (and is remembered)."""
    import xgrammar as xgr

    if kind not in CONSTRAINT_KINDS:
        raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")
    try:
        if kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "json_schema":
            xgr.Grammar.from_json_schema(_json_schema_text(text), any_whitespace=False)
        else:
            xgr.Grammar.from_ebnf(text)
    except ValueError:
        raise
    except Exception as err:  # xgrammar reports syntax errors as RuntimeError
        raise ValueError(f"invalid {kind}: {describe_error(err)}") from None


_BYTE_PENALTIES = torch.tensor(
    [[0.0 if byte >> bit & 1 else float("-inf") for bit in range(8)] for byte in range(256)]
)
"""(256, 8): the penalty of each of the eight tokens a bitmask byte covers."""


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        return self._matcher.is_completed()

    def jump_forward_string(self) -> str:
        return self._matcher.find_jump_forward_string()


class XGrammarBackend(GrammarBackend):
    """xgrammar's compiler over the model's tokenizer, built on the first compilation (in
    the pool), so unconstrained servers never pay for it.

    The tokenizer's vocabulary is padded to the model's ``vocab_size``; padding ids are
    never allowed. ``stop_token_ids`` (the model's EOS ids) end a grammar.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        super().__init__(vocab_size)
        self.tokenizer = tokenizer
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiler_lock = threading.Lock()

    def compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, key: GrammarKey) -> Any:
        check_constraint(key.kind, key.text)
        compiler = self.compiler()
        try:
            if key.kind == "regex":
                return compiler.compile_regex(key.text)
            if key.kind == "json_schema":
                return compiler.compile_json_schema(_json_schema_text(key.text),
                                                    any_whitespace=False)
            return compiler.compile_grammar(key.text)
        except Exception as err:
            raise ValueError(f"invalid {key.kind}: {describe_error(err)}") from None

    def new_matcher(self, compiled: Any) -> XGrammarMatcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """On the CPU, each byte of the bitmask indexes a table of eight additive penalties
        (0 allowed, -inf banned) and the result is added to the logits: about 20 us per
        49k-token row, against about 100 us for a boolean ``masked_fill`` and 160 us for
        xgrammar's CPU kernel (benchmarks/bench_grammar.py).

        Elsewhere the bitmask (host memory, filled by xgrammar) is copied to the logits'
        device without waiting for it, and applied there: by xgrammar's kernel on CUDA, by
        unpacking its bits with tensor ops on any other device (``meta`` included)."""
        if logits.device.type == "cpu":
            if sys.byteorder == "little":
                _apply_byte_penalties(logits, bitmask, rows, self.vocab_size)
            else:
                import xgrammar as xgr

                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                                indices=rows)
            return
        if logits.device.type == "cuda" and _has_triton():
            import xgrammar as xgr

            words = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, words, vocab_size=self.vocab_size,
                                            indices=rows)
            return
        _apply_unpacked_bits(logits, bitmask, rows, self.vocab_size)


def _apply_byte_penalties(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                          vocab: int) -> None:
    """The CPU path of ``apply_bitmask`` (little-endian hosts)."""
    # Bit j of int32 word i allows token 32 i + j: in little-endian bytes, byte b holds
    # tokens 8 b .. 8 b + 7, low bit first.
    leading = rows == list(range(len(rows)))  # rows 0 .. N-1: slices, not copies
    words = bitmask[: len(rows)] if leading else bitmask[rows]
    codes = words.view(torch.uint8).reshape(-1).long()  # (N * 4 W,)
    penalty = _BYTE_PENALTIES.index_select(0, codes).view(len(rows), -1)[:, :vocab]
    if penalty.dtype != logits.dtype:
        penalty = penalty.to(logits.dtype)
    if leading:
        logits[: len(rows), :vocab].add_(penalty)
    else:
        logits[rows, :vocab] += penalty


def _apply_unpacked_bits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                         vocab: int) -> None:
    """``apply_bitmask`` with tensor ops only, on the logits' device: bit j of word i of a
    row allows token 32 i + j."""
    device = logits.device
    leading = rows == list(range(len(rows)))
    words = (bitmask[: len(rows)] if leading else bitmask[rows]).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()  # (N, V)
    if leading:
        logits[: len(rows), :vocab].masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)  # (N,)
    masked = logits.index_select(0, index)
    masked[:, :vocab].masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)


@functools.cache
def _has_triton() -> bool:
    """Whether xgrammar's CUDA kernel (written in Triton) can run."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
