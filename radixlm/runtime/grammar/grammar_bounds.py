"""How much work a grammar can make its matcher do, read from xgrammar's serialized grammar,
so that no request's constraint can exhaust the scheduler's time or memory (issue 54).

The danger is jump-forward: xgrammar's ``find_jump_forward_string`` takes one forced byte at
a time, with no length limit, keeping parser state for each (its cost per byte: see
benchmarks/RESULTS.md), until the text is complete or the next byte is not unique. Under
``root ::= "a" root`` it never stops (the scheduler grew until it was killed).
A forced text is never longer than the shortest completion of the text so far (after that
many forced bytes the text would be that completion, so complete, and the walk stops), so
bounding shortest completions bounds the walk:

* ``measure`` (run by ``check_constraint`` where a request enters) refuses, with a
  ``ValueError`` naming the constraint kind and the rule, a grammar in which some part
  reachable from the root can be started but never finished (``root ::= "a" root``), or
  cannot be finished in ``MAX_SHORTEST_COMPLETION`` bytes (``a1 ::= a2 a2`` nested 40 deep,
  ``"a"{1000000000}``); and a grammar of over ``MAX_GRAMMAR_EXPRESSIONS`` expressions.
* The shortest completion can still grow with the text (after ``"a" * n + "c"`` under
  ``root ::= "a" root "b"{90000} | "c"`` it is 90,000 n bytes). ``GrammarBounds`` bounds it
  from the bytes accepted so far; the matcher does not jump forward (it decodes token by
  token, still masked) where that bound passes ``MAX_FORCED_BYTES``.

The run-time bound. Take, among the derivations of the text q, one whose completion is
shortest. Each open frame (a partly matched rule body) owes the shortest expansion of the
rest of its body. Two frames of one rule starting at one position can be merged (the inner
replaces the outer, which only shortens the completion), so the frames starting at one
position have distinct rules; and a reference between rules that lies on no cycle of
references occurs at most once in the chain of frames. With a reference's "tail" the
shortest expansion of what follows it in its rule's body:

    shortest completion(q) <= terminal + acyclic + (len(q) + 1) * cyclic

``terminal``: the most the innermost frame can owe (the rest of a partly matched literal or
character, plus the rest of its body); ``acyclic``: the heaviest chain of tails of references
on no cycle, from the root; ``cyclic``: the sum of tails of references on a cycle (0 unless
the grammar nests with something owed after the nested part, like JSON's closing brackets,
where it is a few bytes). Lookahead assertions consume nothing and are left out.

The grammar is read from xgrammar's ``serialize_json`` by ``grammar_graph.py`` (layout
checked for version ``"v18"``, xgrammar 0.2.9). A grammar in another version or layout, or
one with token-level expressions (whose byte lengths depend on the vocabulary), is
``UNMEASURED``: nothing in it is refused for its shape, and its matcher never jumps forward.
Regexes inside a grammar (JSON schema patterns) are measured on xgrammar's grammar of the
pattern, their lengths as spelled inside a JSON string where they match one.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.runtime.grammar.grammar_graph import (
    BYTE_STRING,
    CHARACTER_CLASS,
    CHARACTER_CLASS_STAR,
    CHOICES,
    EMPTY_STRING,
    EXCLUDE_TOKEN,
    REGEX,
    REPEAT,
    RULE_REF,
    SEQUENCE,
    SUBSTRING,
    TAG_DISPATCH,
    TOKEN,
    TOKEN_KINDS,
    TOKEN_TAG_DISPATCH,
    GrammarGraph,
    UnreadableGrammar,
    byte_string_length,
    class_shortest,
    read_graph,
    strongly_connected_components,
)

logger = logging.getLogger(__name__)

MAX_SHORTEST_COMPLETION = 100_000
"""Bytes: the most a reachable part of a grammar may need to be finished, so the most text a
jump-forward starting there forces (a walk of milliseconds: benchmarks/RESULTS.md). The
shortest valid output of a real schema or grammar is far below; one that needs more is
refused rather than served past any output budget."""
MAX_GRAMMAR_EXPRESSIONS = 20_000
"""Expressions in xgrammar's form of a grammar. Compiling against the vocabulary grows faster
than linearly in them (benchmarks/RESULTS.md): this keeps a compile to seconds of the
pool's time."""
MAX_FORCED_BYTES = 1 << 20
"""The most text one jump-forward may have to walk (a fraction of a second at worst:
benchmarks/RESULTS.md); past this bound the matcher decodes token by token instead."""
_SATURATED = 1 << 62
"""Lengths are kept exact up to here (a 40-deep doubling is 2^40; nothing needs more)."""
_JSON_ESCAPE = 6
"""Most bytes one byte of a JSON string's content takes spelled (``\\u001f``)."""
_HINTS = {
    "json_schema": " (a required property or item refers back to a schema that contains it)",
}
"""What a refusal adds, by constraint kind, to say where such a grammar comes from."""


@dataclass(frozen=True)
class GrammarBounds:
    """Bounds on the shortest completion of any text a grammar's matcher accepted (see the
    module docstring): ``terminal + acyclic + (accepted bytes + 1) * cyclic``."""

    terminal: int
    acyclic: int
    cyclic: int
    measured: bool = True
    """False when the grammar could not be read; then no bound is known."""

    def forced_bytes(self, accepted_bytes: int) -> float:
        """The most text jump-forward can force after ``accepted_bytes`` bytes (inf when not
        measured)."""
        if not self.measured:
            return math.inf
        return self.terminal + self.acyclic + (accepted_bytes + 1) * self.cyclic

    def allows_jump_forward(self, accepted_bytes: int) -> bool:
        """Whether jump-forward's walk after ``accepted_bytes`` bytes is within
        ``MAX_FORCED_BYTES``."""
        return self.forced_bytes(accepted_bytes) <= MAX_FORCED_BYTES


UNMEASURED = GrammarBounds(0, 0, 0, measured=False)


def measure(kind: str, serialized: str, regex_grammar: Callable[[str], str]) -> GrammarBounds:
    """The bounds of the grammar ``serialized`` (xgrammar's ``serialize_json``) of a
    ``kind`` constraint; ``ValueError`` naming ``kind`` if it is refused (see the module
    docstring). ``regex_grammar(pattern)`` is the serialized grammar of a regex, to measure
    the patterns the grammar embeds."""
    try:
        graph = read_graph(serialized)
    except UnreadableGrammar as err:
        _warn_once(f"grammar not measured ({err}); jump-forward is off for such grammars")
        return UNMEASURED
    if len(graph.kinds) > MAX_GRAMMAR_EXPRESSIONS:
        raise ValueError(f"{kind} is too large: it compiles to {len(graph.kinds):,} grammar "
                         f"expressions, over the limit of {MAX_GRAMMAR_EXPRESSIONS:,}")
    return _Measurement(kind, graph, regex_grammar, json_string=False).bounds()


@functools.lru_cache(maxsize=64)
def _warn_once(message: str) -> None:
    logger.warning(message)


class _Measurement:
    """One grammar's shortest lengths, checks and bounds. Nodes are the expressions
    (0 .. E-1) then the rules (E + rule id)."""

    def __init__(self, kind: str, graph: GrammarGraph, regex_grammar: Callable[[str], str],
                 json_string: bool, where: str | None = None):
        self.kind = kind
        self.where = where or kind
        """What the messages name: the constraint kind, or a pattern inside it."""
        self.graph = graph
        self.regex_grammar = regex_grammar
        self.json_string = json_string
        """Lengths are of the text spelled inside a JSON string (escapes included)."""
        self.measured = True
        self.regexes: dict[int, GrammarBounds | None] = {}
        self.shortest = self._shortest_lengths()

    # Shortest lengths: Knuth's generalization of Dijkstra's algorithm (sums, minimums and
    # multiples by a count of at least 1 never fall below their arguments, so a node's length
    # is final when it leaves the heap). A node that never does has no finite expansion.

    def _shortest_lengths(self) -> list[int | None]:
        graph = self.graph
        first_rule = len(graph.kinds)
        size = first_rule + len(graph.rule_bodies)
        parents: list[list[int]] = [[] for _ in range(size)]
        waiting = [0] * size  # a sum's arguments not yet final
        total = [0] * size
        factor = [1] * size
        heap: list[tuple[int, int]] = []
        for node in range(first_rule):
            kind, args = graph.kinds[node], graph.args[node]
            if kind in (SEQUENCE, CHOICES):
                for child in args:
                    parents[child].append(node)
                waiting[node] = len(args) if kind == SEQUENCE else 1
                if not args and kind == SEQUENCE:
                    heap.append((0, node))
            elif kind == RULE_REF:
                parents[first_rule + args[0]].append(node)
                waiting[node] = 1
            elif kind == REPEAT and args[1] > 0:
                parents[first_rule + args[0]].append(node)
                waiting[node], factor[node] = 1, args[1]
            else:
                length = self._leaf_length(node)
                if length is not None:
                    heap.append((length, node))
        for rule, body in enumerate(graph.rule_bodies):
            parents[body].append(first_rule + rule)
            waiting[first_rule + rule] = 1
        heapq.heapify(heap)
        shortest: list[int | None] = [None] * size
        while heap:
            length, node = heapq.heappop(heap)
            if shortest[node] is not None:
                continue
            shortest[node] = length
            for parent in parents[node]:
                if shortest[parent] is not None or waiting[parent] == 0:
                    continue
                waiting[parent] -= 1
                total[parent] = min(total[parent] + length * factor[parent], _SATURATED)
                if waiting[parent] == 0:
                    heapq.heappush(heap, (total[parent], parent))
        return shortest

    def _leaf_length(self, node: int) -> int | None:
        """The shortest text of an expression that refers to no other (None: none)."""
        kind, args = self.graph.kinds[node], self.graph.args[node]
        if kind == BYTE_STRING:
            return byte_string_length(args, self.json_string)
        if kind == CHARACTER_CLASS:
            return class_shortest(args, self.json_string)
        if kind == REGEX:
            inner = self._regex(node)
            return 0 if inner is None else inner[0]  # not measured: refuse nothing for it
        if kind in (TOKEN, EXCLUDE_TOKEN):
            self.measured = False
            return 1
        if kind == TOKEN_TAG_DISPATCH:
            self.measured = False
        return 0  # a star, empty string, substring, tag dispatch; a repeat taken 0 times

    def _regex(self, node: int) -> tuple[int, GrammarBounds] | None:
        """A Regex expression's shortest length and bounds, from xgrammar's grammar of its
        pattern (refusals there are this grammar's); None when that cannot be read."""
        if node not in self.regexes:
            args = self.graph.args[node]
            pattern = bytes(args[1:]).decode("utf-8", errors="replace")
            self.regexes[node] = None
            try:
                graph = read_graph(self.regex_grammar(pattern))
            except (UnreadableGrammar, ValueError, RuntimeError) as err:
                reason = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
                _warn_once(f"pattern {pattern!r} not measured ({reason}); jump-forward is off "
                           f"for grammars with it")
                self.measured = False
                return None
            inner = _Measurement(self.kind, graph, self.regex_grammar, bool(args[0]),
                                 where=f"{self.where}: pattern {pattern!r}")
            bounds = inner.bounds()
            self.measured &= inner.measured
            root = inner.shortest[len(graph.kinds) + graph.root]
            self.regexes[node] = (_SATURATED if root is None else root, bounds)
        return self.regexes[node]

    # Which parts can be reached, started, finished.

    def _reachable(self) -> tuple[list[int], dict[int, int]]:
        """Nodes reachable from the root rule in a context where they can be matched (a
        sequence's element only when those before it can finish), in breadth-first order,
        and the rule each expression was reached in."""
        graph, first_rule = self.graph, len(self.graph.kinds)
        start = first_rule + graph.root
        order, owner, seen = [start], {start: graph.root}, {start}
        for node in order:
            rule = node - first_rule if node >= first_rule else owner[node]
            for child in self._context_children(node):
                if child not in seen:
                    seen.add(child)
                    order.append(child)
                    owner[child] = child - first_rule if child >= first_rule else rule
        return order, owner

    def _context_children(self, node: int) -> list[int]:
        graph, first_rule = self.graph, len(self.graph.kinds)
        if node >= first_rule:
            lookahead = graph.rule_lookaheads[node - first_rule]
            return [graph.rule_bodies[node - first_rule]] + ([lookahead] if lookahead >= 0 else [])
        kind, args = graph.kinds[node], graph.args[node]
        if kind == SEQUENCE:
            children = []
            for child in args:
                children.append(child)
                if self.shortest[child] is None:
                    break
            return children
        if kind == CHOICES:
            return list(args)
        if kind == RULE_REF or (kind == REPEAT and args[2] != 0):
            return [first_rule + args[0]]
        return [first_rule + rule for rule in graph.dispatched_rules(node)] + (
            graph.tag_exprs(node) if kind == TAG_DISPATCH else [])

    def _startable(self) -> list[bool]:
        """Whether each node can take a first byte (least fixpoint)."""
        graph, first_rule = self.graph, len(self.graph.kinds)
        size = len(self.shortest)
        can = [False] * size
        dependents: list[list[int]] = [[] for _ in range(size)]
        work = []
        for node in range(first_rule):
            kind, args = graph.kinds[node], graph.args[node]
            if kind in (SEQUENCE, CHOICES):
                for child in args:
                    dependents[child].append(node)
            elif kind in (RULE_REF, REPEAT):
                if kind == RULE_REF or args[2] != 0:
                    dependents[first_rule + args[0]].append(node)
            elif kind != EMPTY_STRING and (args or kind != BYTE_STRING):
                work.append(node)
        for rule, body in enumerate(graph.rule_bodies):
            dependents[body].append(first_rule + rule)
        while work:
            node = work.pop()
            if can[node]:
                continue
            can[node] = True
            for parent in dependents[node]:
                if not can[parent] and self._starts(parent, can):
                    work.append(parent)
        return can

    def _starts(self, node: int, can: list[bool]) -> bool:
        if node >= len(self.graph.kinds) or self.graph.kinds[node] != SEQUENCE:
            return True  # a choice, reference, repeat or rule whose child can start
        for child in self.graph.args[node]:
            if can[child]:
                return True
            if self.shortest[child] != 0:
                return False
        return False

    def _refuse_unbounded(self, order: list[int], owner: dict[int, int]) -> None:
        graph, first_rule = self.graph, len(self.graph.kinds)
        can = self._startable()
        endless = [node for node in order if self.shortest[node] is None and can[node]]
        if endless:
            node = next((n for n in endless if n >= first_rule), endless[0])
            name = graph.rule_names[owner[node]]
            raise ValueError(
                f"{self.where} can never be completed: rule {name!r} can be started but "
                f"never finished (every expansion of it leads back to itself or to another "
                f"such rule)"
                f"{_HINTS.get(self.where, '')}")
        long = [node for node in order if (self.shortest[node] or 0) > MAX_SHORTEST_COMPLETION]
        if long:
            node = next((n for n in long if n >= first_rule), long[0])
            length = self.shortest[node]
            shown = f"{length:,}" if length < _SATURATED else f"over {_SATURATED:,}"
            raise ValueError(
                f"{self.where} is too long to complete: the shortest text finishing rule "
                f"{graph.rule_names[owner[node]]!r} is {shown} bytes, over the limit of "
                f"{MAX_SHORTEST_COMPLETION:,}")

    # The run-time bound.

    def bounds(self) -> GrammarBounds:
        """The grammar's bounds; ``ValueError`` if it is refused."""
        order, owner = self._reachable()
        self._refuse_unbounded(order, owner)
        first_rule = len(self.graph.kinds)
        terminal = inner_cyclic = 0
        edges: dict[tuple[int, int], int] = {}  # (rule, referenced rule) -> most owed after

        def refer(source: int, target: int, owed: int) -> None:
            edges[source, target] = max(edges.get((source, target), 0), owed)

        for rule in (node - first_rule for node in order if node >= first_rule):
            for leaf, after in self._positions(rule):
                kind, args = self.graph.kinds[leaf], self.graph.args[leaf]
                if kind == RULE_REF:
                    refer(rule, args[0], after)
                elif kind == REPEAT:  # the iterations still owed after the current one
                    each = self.shortest[first_rule + args[0]] or 0
                    refer(rule, args[0], min(after + max(args[1] - 1, 0) * each, _SATURATED))
                elif kind == REGEX:
                    inner = self._regex(leaf)
                    if inner is not None:
                        terminal = max(terminal, inner[1].terminal + inner[1].acyclic + after)
                        inner_cyclic = max(inner_cyclic, inner[1].cyclic)
                else:
                    for target in self.graph.dispatched_rules(leaf):
                        refer(rule, target, after)
                    terminal = max(terminal, self._rest_of_leaf(leaf) + after)
        if not self.measured:
            return UNMEASURED
        acyclic, cyclic = _chain_weights(self.graph.root, edges)
        return GrammarBounds(terminal, acyclic, cyclic + inner_cyclic)

    def _positions(self, rule: int) -> list[tuple[int, int]]:
        """The leaves and references of a rule's body, each with the shortest length of what
        follows it in the body (down sequences and choices, not into other rules)."""
        found, stack = [], [(self.graph.rule_bodies[rule], 0)]
        while stack:
            node, after = stack.pop()
            kind, args = self.graph.kinds[node], self.graph.args[node]
            if kind == CHOICES:
                stack.extend((child, after) for child in args)
            elif kind == SEQUENCE:
                for child in reversed(args):
                    stack.append((child, after))
                    after = min(after + (self.shortest[child] or 0), _SATURATED)
            elif kind != EMPTY_STRING:
                found.append((node, after))
        return found

    def _rest_of_leaf(self, node: int) -> int:
        """The most a partly matched leaf can still owe."""
        kind, args = self.graph.kinds[node], self.graph.args[node]
        if kind in (CHARACTER_CLASS, CHARACTER_CLASS_STAR, SUBSTRING):
            return 12 if self.json_string else 4  # a UTF-8 character; "\\ud83d\\ude00"
        if kind == TAG_DISPATCH:
            return max((self.shortest[tag] or 0 for tag in self.graph.tag_exprs(node)),
                       default=0)
        if kind in TOKEN_KINDS:
            return 0  # not measured: the matcher never jumps forward
        return len(args) * (_JSON_ESCAPE if self.json_string else 1)


def _chain_weights(root: int, edges: dict[tuple[int, int], int]) -> tuple[int, int]:
    """(heaviest chain of tails of references on no cycle, from ``root``; sum of the tails
    of references on a cycle)."""
    successors: dict[int, list[int]] = {}
    for source, target in edges:
        successors.setdefault(source, []).append(target)
        successors.setdefault(target, [])
    component = strongly_connected_components(successors)
    cyclic = sum(owed for (source, target), owed in edges.items()
                 if component[source] == component[target])
    # Tarjan numbers components sinks first, so each one's successors are already done.
    heaviest: dict[int, int] = {}
    by_component: dict[int, list[tuple[int, int]]] = {}
    for (source, target), owed in edges.items():
        if component[source] != component[target]:
            by_component.setdefault(component[source], []).append((target, owed))
    for index in sorted(set(component.values())):
        heaviest[index] = max((owed + heaviest[component[target]]
                               for target, owed in by_component.get(index, [])), default=0)
    return (heaviest[component[root]] if root in component else 0), cyclic
