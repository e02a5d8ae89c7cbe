"""The sampling settings and state of the running batch, kept across steps as tensors on the
logits' device.

A ``SamplingBatch`` has one row per request. It is updated as requests join (``add``) and
leave (``remove``) and as their output grows (``record_sampled`` for drawn tokens, on the
device; ``record_appended`` for tokens appended without a draw, such as jump-forward's), so
a step builds nothing from Python lists: a greedy-only batch holds no tensors at all, and
its sampling is one argmax.

Invariants:

- Rows: row ``i`` belongs to ``reqs[i]``. The scheduler keeps ``reqs`` equal to its running
  requests, in order: a request gets its row the first time it is sampled after admission
  (or re-admission after retraction), and loses it when it finishes, is aborted or is
  retracted. The requests sampled in one step are consecutive rows (``select``): the whole
  batch in a decode step, the rows just added in an extend step.
- Device: every tensor lives on ``device``, the device the logits are computed on.
- Columns: a setting's tensors exist exactly while some row uses the setting (``FEATURES``);
  rows that do not use it hold its neutral value. Column tensors have K = ``len(reqs)`` rows;
  token lists are (K, n) tensors padded as ``penalties`` explains, and token counts live in
  a ``CountPool`` whose slot for row ``i`` is ``count_slots[i]``.
- Token state: ``output_ids``, ``seen_ids``, the counts and ``output_lens`` describe each
  row's prompt and ``output_ids`` as they are when the row is next sampled.
- Host state: which settings are used (counted per feature), seeds, grammar matchers, and
  each row's output length as recorded here (its position, for seeds, ``min_new_tokens``
  and a thinking budget, ``reasoning_budget``; counted from the request's output when it
  joins, then by ``record_*``, so a sampler can run ahead of the host appending the
  tokens). The sampler decides what to run from these, never by reading a device tensor
  back.

Joining and leaving cost O(rows x listed tokens), plus O(V) per joining row with a
frequency or presence penalty (its counts); nothing is O(rows x V).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from radixlm.host_to_device import to_device
from radixlm.runtime.sampling import penalties, reasoning_budget
from radixlm.runtime.sampling.reasoning_budget import BUDGET
from radixlm.runtime.sampling.token_rows import CountPool, TokenRows

if TYPE_CHECKING:
    from radixlm.runtime.grammar.grammar_backend import GrammarMatcher
    from radixlm.runtime.sampling.sampling_params import SamplingParams


class SamplingRequest(Protocol):
    """What a batch reads of a request (the runtime's ``Req`` is one)."""

    sampling: SamplingParams
    input_ids: list[int]
    output_ids: list[int]
    grammar: GrammarMatcher | None


SAMPLED = "sampled"  # not greedy
SEEDED = "seeded"  # sampled with a sampling_seed
TOP_K_P = "top_k_top_p"
MIN_P = "min_p"
FREQUENCY = "frequency"  # frequency or presence penalty
REPETITION = "repetition"
BIAS = "logit_bias"
MIN_TOKENS = "min_new_tokens"
GRAMMAR = "grammar"

FEATURES: dict[str, tuple[str, ...]] = {
    # feature: the columns it needs (seeds and grammars are host state)
    SAMPLED: ("temperatures", "greedy"),
    SEEDED: (),
    TOP_K_P: ("top_ks", "top_ps"),
    MIN_P: ("min_ps",),
    FREQUENCY: ("frequency_penalties", "presence_penalties", "output_ids", "count_slots"),
    REPETITION: ("repetition_penalties", "seen_ids"),
    BIAS: ("bias_ids", "bias_values"),
    MIN_TOKENS: ("ban_below", "output_lens", "banned_ids"),
    GRAMMAR: (),
    BUDGET: reasoning_budget.COLUMNS,
}
_COLUMNS = tuple(name for names in FEATURES.values() for name in names)


def features_of(req: SamplingRequest) -> frozenset[str]:
    params = req.sampling
    found = []
    if not params.is_greedy:  # a greedy row's filters change nothing
        found.append(SAMPLED)
        if params.sampling_seed is not None:
            found.append(SEEDED)
        if params.top_k > 0 or params.top_p < 1.0:
            found.append(TOP_K_P)
        if params.min_p > 0.0:
            found.append(MIN_P)
    if params.frequency_penalty or params.presence_penalty:
        found.append(FREQUENCY)
    if params.repetition_penalty != 1.0:
        found.append(REPETITION)
    if params.logit_bias:
        found.append(BIAS)
    if params.min_new_tokens > 0:
        found.append(MIN_TOKENS)
    if req.grammar is not None:
        found.append(GRAMMAR)
    if reasoning_budget.has_budget(req):
        found.append(BUDGET)
    return frozenset(found)


class SamplingBatch:
    """The rows of the running requests' sampling settings and state (see the module)."""

    temperatures: torch.Tensor | None  # (K, 1) float32, at least 1e-6
    greedy: torch.Tensor | None  # (K,) bool
    top_ks: torch.Tensor | None  # (K, 1) int64, V where disabled
    top_ps: torch.Tensor | None  # (K, 1) float32, inf where disabled
    min_ps: torch.Tensor | None  # (K, 1) float32
    frequency_penalties: torch.Tensor | None  # (K, 1) float32
    presence_penalties: torch.Tensor | None  # (K, 1) float32
    output_ids: torch.Tensor | None  # (K, n) int64: the output's tokens, padded with 0
    count_slots: torch.Tensor | None  # (K,) int64: each row's slot in ``count_table``
    count_table: torch.Tensor | None  # (slots, V) int32: tokens' counts in the output
    repetition_penalties: torch.Tensor | None  # (K, 1) float32
    seen_ids: torch.Tensor | None  # (K, n) int64: prompt and output tokens, padded
    bias_ids: torch.Tensor | None  # (K, n) int64, padded with 0
    bias_values: torch.Tensor | None  # (K, n) float32, padded with 0.0
    ban_below: torch.Tensor | None  # (K, 1) int64: stop tokens banned while output_lens < this
    output_lens: torch.Tensor | None  # (K, 1) int64: len(output_ids)
    banned_ids: torch.Tensor | None  # (K, n) int64, padded
    budget_ends: torch.Tensor | None  # (K, M) int64: see ``reasoning_budget``
    budget_window: torch.Tensor | None  # (K, M) int64
    budget_matched: torch.Tensor | None  # (K, 1) bool

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        self.reqs: list[SamplingRequest] = []
        self._features: list[frozenset[str]] = []  # per row
        self._used: Counter[str] = Counter()  # rows using each feature
        self._rows: dict[int, int] = {}  # id(request) -> row
        self._store: dict[str, torch.Tensor | TokenRows] = {}  # column name -> its rows
        self._counts = CountPool(vocab_size, self.device)
        self._slots: list[int] = []  # count_slots on the host, while they exist
        self._positions: list[int] = []  # per row: its output length, as recorded
        self._parent: SamplingBatch | None = None  # for a view: its batch and rows
        self._view_rows = slice(None)
        self._publish()

    def __len__(self) -> int:
        return len(self.reqs)

    def __contains__(self, req: SamplingRequest) -> bool:
        return id(req) in self._rows

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on this batch's device (``cuda`` matches ``cuda:0``)."""
        device = tensor.device
        return device.type == self.device.type and (
            device.index is None or self.device.index is None or device.index == self.device.index)

    def uses(self, feature: str) -> bool:
        """Whether some row uses ``feature`` (one of ``FEATURES``)."""
        return self._used[feature] > 0

    # Membership ----------------------------------------------------------------------------

    def add(self, reqs: Sequence[SamplingRequest]) -> None:
        """Gives a row, after the existing ones, to each of ``reqs`` without one."""
        self._check_mutable()
        if self._is_every_row(reqs):  # a decode step's: nothing to add
            return
        new = []
        for req in reqs:
            if id(req) not in self._rows:
                self._rows[id(req)] = len(self.reqs)
                self.reqs.append(req)
                self._features.append(features_of(req))
                self._used.update(self._features[-1])
                self._positions.append(len(req.output_ids))
                new.append(req)
        if not new:
            return
        for feature, names in FEATURES.items():
            if not names or not self.uses(feature):
                continue
            if names[0] not in self._store:  # the first row using it: build every row
                self._store.update(zip(names, _BUILDERS[feature](self, self.reqs)))
                continue
            for name, rows in zip(names, _BUILDERS[feature](self, new)):
                kept = self._store[name]
                if isinstance(kept, TokenRows):
                    kept.extend(rows)
                else:
                    self._store[name] = torch.cat([kept, rows])
        self._publish()

    def remove(self, reqs: Sequence[SamplingRequest]) -> None:
        """Drops the rows of ``reqs`` (those that have one); the others keep their order."""
        self._check_mutable()
        dropped = {self._rows[id(r)] for r in reqs if id(r) in self._rows}
        if not dropped:
            return
        keep = [row for row in range(len(self.reqs)) if row not in dropped]
        for row in dropped:
            self._used.subtract(self._features[row])
        self.reqs = [self.reqs[row] for row in keep]
        self._features = [self._features[row] for row in keep]
        self._positions = [self._positions[row] for row in keep]
        self._rows = {id(req): row for row, req in enumerate(self.reqs)}
        if self._slots:
            self._counts.free([self._slots[row] for row in sorted(dropped)])
            self._slots = [self._slots[row] for row in keep]
        index = None
        for feature, names in FEATURES.items():
            if not names or names[0] not in self._store:
                continue
            if not self.uses(feature):
                for name in names:
                    del self._store[name]
                if feature == FREQUENCY:
                    self._counts.free(self._slots)
                    self._slots = []
                continue
            if index is None:
                index = to_device(keep, torch.int64, self.device)
            for name in names:
                kept = self._store[name]
                if isinstance(kept, TokenRows):
                    kept.keep(keep, index)
                else:
                    self._store[name] = kept.index_select(0, index)
        self._publish()

    def select(self, reqs: Sequence[SamplingRequest]) -> SamplingBatch:
        """The rows of ``reqs``, which must be consecutive rows in order: the batch itself, or
        a view sharing its tensors (recording into the view updates the batch). A view is
        for one step: read it and record into it, but add and remove on the batch."""
        if self._is_every_row(reqs):
            return self
        start = self._rows.get(id(reqs[0])) if reqs else 0
        if start is None or any(
            self._rows.get(id(req)) != start + i for i, req in enumerate(reqs)
        ):
            raise ValueError("the requests sampled together must hold consecutive rows of the "
                             "sampling batch, in order")
        return self._view(slice(start, start + len(reqs)))

    def _is_every_row(self, reqs: Sequence[SamplingRequest]) -> bool:
        """Whether ``reqs`` are this batch's rows, in order (by identity)."""
        return len(reqs) == len(self.reqs) and all(map(operator.is_, reqs, self.reqs))

    # Token state ---------------------------------------------------------------------------

    def record_sampled(self, tokens: torch.Tensor, rows: slice = slice(None)) -> None:
        """Appends ``tokens`` (K,) int64, one drawn for each row (of ``rows``), on the device,
        to the rows' output (no host sync)."""
        if self._parent is not None:
            self._parent.record_sampled(tokens, self._view_rows)
            return
        self._advance(range(*rows.indices(len(self.reqs))), 1)
        if self._store:
            self._append(tokens.view(-1, 1), rows)

    def record_appended(self, req: SamplingRequest, tokens: list[int]) -> None:
        """Appends tokens added to ``req``'s output without a draw (jump-forward)."""
        self._advance([self._rows[id(req)]], len(tokens))
        if tokens and any(n in self._store for n in ("output_ids", "seen_ids", "output_lens",
                                                     "budget_window")):
            row = self._rows[id(req)]
            ids = to_device(tokens, torch.int64, self.device)
            self._append(ids[None, :], slice(row, row + 1))

    # What the sampler reads on the host -----------------------------------------------------

    def is_plain_greedy(self) -> bool:
        """Whether every row is greedy with no setting that changes its logits."""
        return self._plain

    def needs_penalties(self) -> bool:
        """Whether bias or penalties change some row's logits."""
        return self.uses(BIAS) or self.uses(FREQUENCY) or self.uses(REPETITION)

    def banning_rows(self) -> list[int]:
        """Rows whose output is still below ``min_new_tokens``."""
        if not self.uses(MIN_TOKENS):
            return []
        return [row for row, req in enumerate(self.reqs)
                if self._positions[row] < req.sampling.min_new_tokens]

    def position(self, row: int) -> int:
        """Row ``row``'s output length as recorded (kept while seeds, ``min_new_tokens`` or
        a reasoning budget read it)."""
        return self._positions[row]

    def matchers(self) -> list[GrammarMatcher | None]:
        return [req.grammar for req in self.reqs]

    def seeded_rows(self) -> list[tuple[int, int, int]]:
        """(row, sampling_seed, output position) of each sampled row with a seed."""
        if not self.uses(SEEDED):
            return []
        return [(row, req.sampling.sampling_seed, self._positions[row])
                for row, (req, features) in enumerate(zip(self.reqs, self._features))
                if SEEDED in features]

    # Internals -----------------------------------------------------------------------------

    def _append(self, columns: torch.Tensor, rows: slice) -> None:
        """Appends ``columns`` (R, m) to the outputs of ``rows``."""
        store = self._store
        if "output_ids" in store:
            store["output_ids"].append(columns, rows)
            self.output_ids = store["output_ids"].values
            slots = store["count_slots"][rows, None].expand_as(columns)
            self._counts.add(slots.reshape(-1), columns.reshape(-1))
        if "seen_ids" in store:
            store["seen_ids"].append(columns, rows)
            self.seen_ids = store["seen_ids"].values
        if "output_lens" in store:
            lens = store["output_lens"]
            (lens if rows == slice(None) else lens[rows]).add_(columns.shape[1])
        if "budget_window" in store:
            reasoning_budget.record(self.budget_ends, self.budget_window, self.budget_matched,
                                    columns, rows)

    def _publish(self) -> None:
        """Points the column attributes at the current storage (and the host flags at the
        current rows)."""
        self._plain = not any(count > 0 for count in self._used.values())
        for name in _COLUMNS:
            kept = self._store.get(name)
            setattr(self, name, kept.values if isinstance(kept, TokenRows) else kept)
        self.count_table = self._counts.table if self._slots else None

    def _view(self, rows: slice) -> SamplingBatch:
        view = SamplingBatch(self.vocab_size, self.eos_token_ids, self.device)
        view._parent, view._view_rows = self, rows
        view.reqs = self.reqs[rows]
        view._features = self._features[rows]
        view._positions = self._positions[rows]
        view._rows = {id(req): row for row, req in enumerate(view.reqs)}
        for features in view._features:
            view._used.update(features)
        view._plain = not any(count > 0 for count in view._used.values())
        for name in _COLUMNS:
            tensor = getattr(self, name)
            setattr(view, name, None if tensor is None else tensor[rows])
        view.count_table = self.count_table
        return view

    def _advance(self, rows: Sequence[int], count: int) -> None:
        """Adds ``count`` tokens to the recorded output length of ``rows`` (kept only while
        some row reads it)."""
        if self.uses(SEEDED) or self.uses(MIN_TOKENS) or self.uses(BUDGET):
            positions = self._positions
            for row in rows:
                positions[row] += count

    def _check_mutable(self) -> None:
        if self._parent is not None:
            raise RuntimeError("add and remove rows on the batch, not on a view of it")


# Building each feature's columns for rows joining the batch ---------------------------------

Rows = Sequence[SamplingRequest]


def _sampling_rows(batch: SamplingBatch, reqs: Rows) -> tuple[torch.Tensor, ...]:
    return (
        penalties.column([max(r.sampling.temperature, 1e-6) for r in reqs], torch.float32,
                         batch.device),
        to_device([r.sampling.is_greedy for r in reqs], torch.bool, batch.device),
    )


def _top_k_p_rows(batch: SamplingBatch, reqs: Rows) -> tuple[torch.Tensor, ...]:
    vocab = batch.vocab_size
    return (
        penalties.column([r.sampling.top_k if r.sampling.top_k > 0 else vocab for r in reqs],
                         torch.int64, batch.device),
        # inf, not 1.0: the mass before a tail token can round to 1.0, and a row that asked
        # for no top-p must keep it whether or not another row makes the batch sort
        penalties.column([r.sampling.top_p if r.sampling.top_p < 1.0 else float("inf")
                          for r in reqs], torch.float32, batch.device),
    )


def _min_p_rows(batch: SamplingBatch, reqs: Rows) -> tuple[torch.Tensor, ...]:
    return (penalties.column([r.sampling.min_p for r in reqs], torch.float32, batch.device),)


def _frequency_rows(batch: SamplingBatch, reqs: Rows) -> tuple[torch.Tensor | TokenRows, ...]:
    """Also takes a count slot for each row (kept on the host in ``batch._slots``)."""
    slots = batch._counts.allocate([r.output_ids for r in reqs])
    batch._slots += slots
    return (*penalties.frequency_rows([r.sampling for r in reqs], [r.output_ids for r in reqs],
                                      batch.vocab_size, batch.device),
            to_device(slots, torch.int64, batch.device))


def _repetition_rows(batch: SamplingBatch, reqs: Rows) -> tuple[torch.Tensor | TokenRows, ...]:
    return penalties.repetition_rows([r.sampling for r in reqs],
                                     [[*r.input_ids, *r.output_ids] for r in reqs],
                                     batch.vocab_size, batch.device)


def _bias_rows(batch: SamplingBatch, reqs: Rows) -> tuple[TokenRows, ...]:
    return penalties.bias_rows([r.sampling for r in reqs], batch.vocab_size, batch.device)


def _ban_rows(batch: SamplingBatch, reqs: Rows) -> tuple[torch.Tensor | TokenRows, ...]:
    return penalties.ban_rows([r.sampling for r in reqs], [len(r.output_ids) for r in reqs],
                              batch.eos_token_ids, batch.device)


_BUILDERS: dict[str, Callable[[SamplingBatch, Rows],
                              tuple[torch.Tensor | TokenRows, ...]]] = {
    SAMPLED: _sampling_rows,
    TOP_K_P: _top_k_p_rows,
    MIN_P: _min_p_rows,
    FREQUENCY: _frequency_rows,
    REPETITION: _repetition_rows,
    BIAS: _bias_rows,
    MIN_TOKENS: _ban_rows,
    BUDGET: lambda batch, reqs: reasoning_budget.budget_rows(reqs, batch.device),
}
"""Per feature with columns: its columns (``FEATURES``' order) for rows ``reqs``."""
