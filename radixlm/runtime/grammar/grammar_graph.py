"""xgrammar's serialized grammar (``Grammar.serialize_json``) read as a graph of expressions
and rules, and the graph algorithm ``grammar_bounds.py`` measures it with (strongly
connected components of rule references).

The layout, as of serialization version ``"v18"`` (xgrammar 0.2.9), checked against the
installed wheel and xgrammar's ``cpp/grammar_impl.h``: ``rules`` holds ``[name,
body_expr_id, lookahead_expr_id (-1: none), ...]``; expression i starts at
``grammar_expr_indptr[i]`` in ``grammar_expr_data`` as ``[type, n, n arguments]``, with
``type`` one of the constants below (``GrammarExprType``'s order) and arguments:

- byte string: its bytes; character class (star): ``negated, lo0, hi0, lo1, hi1, ...``
  (code points); empty string: none; rule reference: ``rule``; sequence, choices: the
  expression ids; repeat: ``rule, min, max`` (max -1: unbounded);
- tag dispatch: ``tag0, rule0, tag1, rule1, ..., loop_after_dispatch, excludes`` (tags and
  excludes are expression ids);
- token, exclude token: token ids; token tag dispatch: ``n, (token, rule) x n, loop, m,
  token x m``; regex: ``json_string, pattern bytes`` (``json_string``: the pattern matches a
  JSON string's decoded content, spelled with escapes); substring: length-prefixed chunks.

Anything else (another version, an unknown type, an id out of range) is
``UnreadableGrammar``, which the caller treats as "not measured", never as valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

(BYTE_STRING, CHARACTER_CLASS, CHARACTER_CLASS_STAR, EMPTY_STRING, RULE_REF, SEQUENCE,
 CHOICES, TAG_DISPATCH, REPEAT, TOKEN, EXCLUDE_TOKEN, TOKEN_TAG_DISPATCH, REGEX,
 SUBSTRING) = range(14)
TOKEN_KINDS = (TOKEN, EXCLUDE_TOKEN, TOKEN_TAG_DISPATCH)
"""Expressions matching whole tokens: their byte lengths depend on the vocabulary."""
VERIFIED_FORMATS = frozenset({"v18"})
"""``serialize_json`` versions whose layout was checked."""


class UnreadableGrammar(Exception):
    """The serialized grammar is not in a layout this module was checked against."""


@dataclass(frozen=True)
class GrammarGraph:
    """A grammar's expressions (``kinds[i]``, ``args[i]``) and rules (``rule_names``,
    ``rule_bodies``, ``rule_lookaheads``: expression ids, -1 for no lookahead). Every id
    in it is in range (checked by ``read_graph``)."""

    kinds: list[int]
    args: list[list[int]]
    rule_names: list[str]
    rule_bodies: list[int]
    rule_lookaheads: list[int]
    root: int

    def dispatched_rules(self, node: int) -> list[int]:
        """The rules a (token) tag dispatch hands over to; [] for other expressions."""
        kind, args = self.kinds[node], self.args[node]
        if kind == TAG_DISPATCH:
            return list(args[1:-2:2])
        if kind == TOKEN_TAG_DISPATCH:
            return list(args[2:1 + 2 * args[0]:2])
        return []

    def tag_exprs(self, node: int) -> list[int]:
        """A tag dispatch's tags (expression ids)."""
        return list(self.args[node][0:-2:2])


def read_graph(serialized: str) -> GrammarGraph:
    """The graph of ``serialized``; ``UnreadableGrammar`` if its layout is not the one
    checked (see the module docstring)."""
    try:
        data = json.loads(serialized)
        version = data.get("__VERSION__")
        if version not in VERIFIED_FORMATS:
            raise UnreadableGrammar(f"serialization version {version!r} is not one of "
                                    f"{sorted(VERIFIED_FORMATS)}")
        flat = data["grammar_expr_data"]
        if not all(type(value) is int for value in flat):
            raise UnreadableGrammar("non-integer expression data")
        kinds, args = [], []
        for start in data["grammar_expr_indptr"]:
            kinds.append(flat[start])
            args.append(flat[start + 2: start + 2 + flat[start + 1]])
        rules = data["rules"]
        graph = GrammarGraph(kinds, args, [str(rule[0]) for rule in rules],
                             [rule[1] for rule in rules], [rule[2] for rule in rules],
                             data["root_rule_id"])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise UnreadableGrammar(f"unexpected layout: {err!r}") from None
    _check_ids(graph)
    return graph


def _check_ids(graph: GrammarGraph) -> None:
    exprs, rules = range(len(graph.kinds)), range(len(graph.rule_bodies))
    if graph.root not in rules:
        raise UnreadableGrammar(f"root rule {graph.root} out of range")
    for body, lookahead in zip(graph.rule_bodies, graph.rule_lookaheads):
        if body not in exprs or not (lookahead == -1 or lookahead in exprs):
            raise UnreadableGrammar(f"rule body {body} or lookahead {lookahead} out of range")
    for node, (kind, args) in enumerate(zip(graph.kinds, graph.args)):
        if not _well_formed(graph, node, kind, args, exprs, rules):
            raise UnreadableGrammar(f"expression {node} (type {kind}): unexpected {args[:8]}")


def _well_formed(graph: GrammarGraph, node: int, kind: int, args: list[int], exprs: range,
                 rules: range) -> bool:
    if kind in (SEQUENCE, CHOICES):
        return all(a in exprs for a in args)
    if kind == RULE_REF:
        return len(args) == 1 and args[0] in rules
    if kind == REPEAT:
        return len(args) == 3 and args[0] in rules and args[1] >= 0
    if kind == TAG_DISPATCH:
        return (len(args) >= 2 and len(args) % 2 == 0
                and all(a in rules for a in graph.dispatched_rules(node))
                and all(a in exprs for a in graph.tag_exprs(node)))
    if kind == TOKEN_TAG_DISPATCH:
        return (len(args) >= 1 and len(args) >= 1 + 2 * args[0]
                and all(a in rules for a in graph.dispatched_rules(node)))
    if kind in (CHARACTER_CLASS, CHARACTER_CLASS_STAR):
        return len(args) % 2 == 1
    if kind == REGEX:
        return len(args) >= 1 and all(0 <= a < 256 for a in args[1:])
    if kind == BYTE_STRING:
        return all(0 <= a < 256 for a in args)
    return kind in (EMPTY_STRING, TOKEN, EXCLUDE_TOKEN, SUBSTRING)


_SHORT_ESCAPES = frozenset(b'"\\\b\f\n\r\t')


def byte_string_length(data: list[int], json_string: bool) -> int:
    """The bytes of a byte string; inside a JSON string, as shortest spelled (a quote,
    backslash or control byte is escaped)."""
    if not json_string:
        return len(data)
    return sum(1 if byte >= 0x20 and byte not in _SHORT_ESCAPES
               else 2 if byte in _SHORT_ESCAPES else 6 for byte in data)


def class_shortest(args: list[int], json_string: bool) -> int:
    """The fewest bytes one character of a class can take (UTF-8; inside a JSON string, the
    shortest spelling, so 6 for a class of control characters only)."""
    negated, bounds = bool(args[0]), args[1:]
    ranges = sorted(zip(bounds[0::2], bounds[1::2]))

    def member_from(low: int) -> int | None:
        """The smallest member of the class at or above ``low``."""
        if not negated:
            return min((max(lo, low) for lo, hi in ranges if hi >= low), default=None)
        candidate = low
        for lo, hi in ranges:
            if lo <= candidate <= hi:
                candidate = hi + 1
        return candidate if candidate <= 0x10FFFF else None

    if json_string:
        plain = member_from(0x20)
        while plain in (0x22, 0x5C):
            plain = member_from(plain + 1)
        if plain is not None:
            return _utf8_length(plain)
        control = member_from(0)
        return 6 if control is None else 2 if control in _SHORT_ESCAPES else 6
    first = member_from(0)
    return 1 if first is None else _utf8_length(first)


def _utf8_length(code_point: int) -> int:
    return 1 if code_point < 0x80 else 2 if code_point < 0x800 else 3 \
        if code_point < 0x10000 else 4


def strongly_connected_components(successors: dict[int, list[int]]) -> dict[int, int]:
    """Each node's strongly connected component (Tarjan's algorithm, iterative: a grammar's
    chains of references may be longer than Python's stack), numbered sinks first: a
    component's successors have smaller numbers."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    component: dict[int, int] = {}
    stack: list[int] = []
    counter = components = 0
    for start in successors:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
            targets = successors[node]
            if position < len(targets):
                work.append((node, position + 1))
                target = targets[position]
                if target not in index:
                    work.append((target, 0))
                elif target not in component:
                    low[node] = min(low[node], index[target])
                continue
            if low[node] == index[node]:
                while True:
                    member = stack.pop()
                    component[member] = components
                    if member == node:
                        break
                components += 1
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return component
