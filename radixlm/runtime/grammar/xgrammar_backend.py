"""The grammar backend on xgrammar (https://github.com/mlc-ai/xgrammar).

xgrammar compiles a grammar against a tokenizer's vocabulary, precomputing which tokens
each grammar position accepts, so a request's mask is filled in microseconds per step.

JSON schemas compile without free whitespace (``any_whitespace=False``): objects print as
``{"key": value, ...}``, which leaves a small model no room to wander in whitespace and
makes keys, colons and separators forced text for jump-forward decoding.

``check_constraint`` parses a constraint without the tokenizer (fast, cached), so bad input
is refused where it enters, in the caller's process, before anything is queued. It also
bounds the work the constraint can cause (``grammar_bounds.py``): a grammar with a reachable
part that can never be finished, or only past ``MAX_SHORTEST_COMPLETION`` bytes, or with over
``MAX_GRAMMAR_EXPRESSIONS`` expressions is refused, and so is a JSON schema nested over
``MAX_SCHEMA_DEPTH`` levels (xgrammar's conversion time grows with about the cube of the
depth: benchmarks/RESULTS.md). Each matcher counts
the bytes it accepted and skips jump-forward where the grammar's bound on the forced text
passes ``MAX_FORCED_BYTES``: xgrammar's ``find_jump_forward_string`` has no length limit of
its own.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.host_to_device import to_device
from radixlm.runtime.grammar.constraints import CONSTRAINT_KINDS, GrammarKey
from radixlm.runtime.grammar.grammar_backend import HOST, GrammarBackend, GrammarMatcher
from radixlm.runtime.grammar.grammar_bounds import GrammarBounds, measure

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
correct, but it makes mask fills one to two orders of magnitude slower inside such strings
(benchmarks/RESULTS.md)."""


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


MAX_SCHEMA_DEPTH = 64
"""Nested JSON objects and arrays in a JSON schema document (32 levels of nested object
schemas, each an object and its ``properties``), where every nesting tried (``items``,
``properties``, ``additionalProperties``, ``allOf``, ``anyOf``, ``oneOf``, ``prefixItems``)
converts quickly (benchmarks/RESULTS.md)."""


def schema_depth(value: Any) -> int:
    """Levels of nested objects and arrays in a parsed JSON document (iteratively: the
    document may be deeper than Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _json_schema_text(text: str) -> str:
    """The schema as xgrammar should compile it; ``ValueError`` if it is not a schema."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"json_schema is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"json_schema is nested too deeply (over {MAX_SCHEMA_DEPTH} "
                         f"levels of objects and arrays)") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (a schema), got "
                         f"{type(schema).__name__}")
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"json_schema is nested {depth} levels of objects and arrays deep, "
                         f"over the limit of {MAX_SCHEMA_DEPTH}")
    return json.dumps(harden_json_schema(schema))


def _structural_tag_text(text: str) -> str:
    """A structural tag as xgrammar should compile it: its JSON schemas hardened and bounded
    in depth as a ``json_schema`` constraint's are; ``ValueError`` if it is not JSON."""
    try:
        tag = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"structural_tag is not valid JSON: {err}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"structural_tag must be a JSON object, got {type(tag).__name__}")
    depth = schema_depth(tag)
    if depth > 2 * MAX_SCHEMA_DEPTH:
        raise ValueError(f"structural_tag is nested {depth} levels deep, over the limit of "
                         f"{2 * MAX_SCHEMA_DEPTH}")
    return json.dumps(_harden_tag_schemas(tag))


def _harden_tag_schemas(value: Any) -> Any:
    """``value`` with each JSON ``json_schema`` content of a structural tag compiled as a
    ``json_schema`` constraint is: hardened, and without free whitespace. xgrammar's tags
    allow any amount of whitespace between JSON tokens (its ``max_whitespace_cnt`` can
    bound it, not remove it), in which a small model can wander until its tokens run out;
    so the schema goes in as the EBNF of ``from_json_schema(any_whitespace=False)``. Other
    styles (``qwen_xml``, ...) keep their own form, bounded to one whitespace a place."""
    if isinstance(value, list):
        return [_harden_tag_schemas(item) for item in value]
    if not isinstance(value, dict):
        return value
    if value.get("type") == "json_schema" and value.get("style", "json") == "json":
        return {"type": "grammar", "grammar": _compact_json_ebnf(value.get("json_schema"))}
    hardened = {key: harden_json_schema(item) if key == "json_schema"
                else _harden_tag_schemas(item) for key, item in value.items()}
    if hardened.get("type") == "json_schema" and hardened.get("max_whitespace_cnt") is None:
        hardened["max_whitespace_cnt"] = 1
    return hardened


def _compact_json_ebnf(schema: Any) -> str:
    """The EBNF of a JSON schema without free whitespace (as ``json_schema`` constraints)."""
    import xgrammar as xgr

    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a structural tag's json_schema must be a JSON schema, got "
                         f"{type(schema).__name__}")
    return str(xgr.Grammar.from_json_schema(json.dumps(harden_json_schema(schema)),
                                            any_whitespace=False))


def check_constraint(kind: str, text: str) -> None:
    """Raises ``ValueError`` naming the field and the problem if ``text`` is not a valid
    ``kind`` (regex, json_schema, ebnf or structural_tag) or its work cannot be bounded; a
    valid one passes (and is remembered)."""
    constraint_bounds(kind, text)


@functools.lru_cache(maxsize=4096)
def constraint_bounds(kind: str, text: str) -> GrammarBounds:
    """The bounds of a valid constraint (see ``check_constraint``, whose errors it raises)."""
    import xgrammar as xgr

    if kind not in CONSTRAINT_KINDS:
        raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")
    try:
        if kind == "regex":
            grammar = xgr.Grammar.from_regex(text)
        elif kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(_json_schema_text(text),
                                                   any_whitespace=False)
        elif kind == "structural_tag":
            grammar = xgr.Grammar.from_structural_tag(_structural_tag_text(text))
        else:
            grammar = xgr.Grammar.from_ebnf(text)
    except ValueError:
        raise
    except Exception as err:  # xgrammar reports syntax errors as RuntimeError
        raise ValueError(f"invalid {kind}: {describe_error(err)}") from None
    return measure(kind, grammar.serialize_json(), regex_grammar_json)


def regex_grammar_json(pattern: str) -> str:
    """The serialized grammar of a regex embedded in a grammar (to measure it)."""
    import xgrammar as xgr

    return xgr.Grammar.from_regex(pattern).serialize_json()


_BYTE_PENALTIES = torch.tensor(
    [[0.0 if byte >> bit & 1 else float("-inf") for bit in range(8)] for byte in range(256)]
)
"""(256, 8): the penalty of each of the eight tokens a bitmask byte covers."""


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar and the bounds measured on it."""

    grammar: Any
    bounds: GrammarBounds


class XGrammarMatcher(GrammarMatcher):
    """An xgrammar matcher that also counts the bytes it accepted (``token_bytes[t]``: the
    bytes of token ``t``), so that jump-forward runs only while ``bounds`` keeps its walk
    within ``MAX_FORCED_BYTES``."""

    def __init__(self, matcher: Any, bounds: GrammarBounds, token_bytes: Sequence[int]):
        self._matcher = matcher
        self._bounds = bounds
        self._token_bytes = token_bytes
        self._accepted: list[int] = []  # bytes of each accepted token, for rollback
        self._accepted_bytes = 0

    def accept_token(self, token_id: int) -> bool:
        if not self._matcher.accept_token(token_id):
            return False
        size = self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else 0
        self._accepted.append(size)
        self._accepted_bytes += size
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)
            for _ in range(num_tokens):
                self._accepted_bytes -= self._accepted.pop()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        return self._matcher.is_completed()

    def jump_forward_string(self) -> str:
        if not self._bounds.allows_jump_forward(self._accepted_bytes):
            return ""
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
        self._token_bytes: tuple[int, ...] = ()
        self._compiler_lock = threading.Lock()

    def compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                )
                self._token_bytes = tuple(len(piece) for piece in info.decoded_vocab)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, key: GrammarKey) -> CompiledConstraint:
        bounds = constraint_bounds(key.kind, key.text)
        compiler = self.compiler()
        try:
            if key.kind == "regex":
                grammar = compiler.compile_regex(key.text)
            elif key.kind == "json_schema":
                grammar = compiler.compile_json_schema(_json_schema_text(key.text),
                                                       any_whitespace=False)
            elif key.kind == "structural_tag":
                grammar = compiler.compile_structural_tag(_structural_tag_text(key.text))
            else:
                grammar = compiler.compile_grammar(key.text)
        except Exception as err:
            raise ValueError(f"invalid {key.kind}: {describe_error(err)}") from None
        return CompiledConstraint(grammar, bounds)

    def new_matcher(self, compiled: CompiledConstraint) -> XGrammarMatcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(compiled.grammar), compiled.bounds,
                               self._token_bytes)

    def allocate_bitmask(self, rows: int, device: torch.device = HOST) -> torch.Tensor:
        """Host memory xgrammar fills; pinned for logits on CUDA, so that its rows go there
        without waiting for the stream. The buffer is reused: the matchers refill it for a
        step only once the step before has been read on the host (its tokens), which was
        after its copy of the bitmask."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        return bitmask.pin_memory() if device.type == "cuda" else bitmask

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """On the CPU, each byte of the bitmask indexes a table of eight additive penalties
        (0 allowed, -inf banned) and the result is added to the logits: faster than a
        boolean ``masked_fill`` and than xgrammar's CPU kernel (benchmarks/bench_grammar.py;
        figures in benchmarks/RESULTS.md).

        Elsewhere the bitmask (host memory, filled by xgrammar; pinned on CUDA) and the
        row numbers (``to_device``) are copied to the logits' device without waiting for
        it, and applied there: by xgrammar's kernel on CUDA, by unpacking its bits with
        tensor ops on any other device (``meta`` included)."""
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
            index = to_device(rows, torch.int32, logits.device)  # (a list: a pageable copy)
            xgr.apply_token_bitmask_inplace(logits, words, vocab_size=self.vocab_size,
                                            indices=index)
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
    # Leading rows of the (pinned) buffer, gathered on the device (not a pageable copy)
    words = bitmask[: rows[-1] + 1].to(device, non_blocking=True)
    index = None if leading else to_device(rows, torch.int64, device)  # (N,)
    if index is not None:
        words = words.index_select(0, index)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()  # (N, V)
    if leading:
        logits[: len(rows), :vocab].masked_fill_(~allowed, float("-inf"))
        return
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
