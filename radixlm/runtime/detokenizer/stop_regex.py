"""Stop regexes searched in time linear in the text, fed incrementally, never backtracking.

Python's ``re`` backtracks: ``(.+)+X`` over a long text without an ``X`` takes exponential
time, and a stop regex is searched on every decoded token. Here a pattern is parsed by
``regex_parser`` (``re``'s syntax and errors, without CPython's private parser), compiled
into a Thompson NFA (a list of instructions), and searched with a Pike VM that runs
``.*?(R)``: one thread per NFA state, each carrying the leftmost text position where a
match through that state could have started. Each character costs O(program size), the
program size is capped (``MAX_PROGRAM_SIZE``), and a cursor keeps the thread list between
calls, so feeding a text in pieces costs what feeding it at once does. (Thompson, "Regular
expression search algorithm", CACM 1968; Cox, "Regular Expression Matching: the Virtual
Machine Approach", 2009.)

What counts as a match: ``text[s:e]`` with ``s < e`` that ``re`` would ``fullmatch`` at
``(s, e)`` (``^`` and ``\\A`` hold only at position 0, or after a newline for ``^`` under
``re.MULTILINE``). Greedy and lazy repeats match the same substrings, so they are not told
apart. Supported: literals, ``.``, classes (ranges, negation, ``\\d \\w \\s`` and their
negations with ``str.isdecimal``/``isalnum``/``isspace`` semantics, ASCII-only under
``re.ASCII``), groups, alternation, bounded and unbounded repeats, ``^``, ``\\A``, and the
flags IGNORECASE, DOTALL, MULTILINE, ASCII and VERBOSE. Everything else is refused by the
parser with a ``ValueError`` naming it: backreferences, lookaround, conditionals, atomic
groups, possessive repeats (they are atomic groups, and treating them as greedy would match
texts ``re`` does not), ``$``, ``\\Z``, ``\\b`` and ``\\B`` (they look at the next character).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from radixlm.runtime.detokenizer.regex_parser import parse_stop_regex
from radixlm.runtime.detokenizer.regex_syntax import (
    AnyChar,
    Begin,
    Branch,
    Category,
    CharRange,
    CharSet,
    Group,
    Literal,
    Node,
    Repeat,
)

MAX_PROGRAM_SIZE = 2000
"""Most NFA instructions one stop regex may compile to (counted before any is built): each
character fed costs up to this many steps."""

_CHAR, _SPLIT, _JMP, _BEGIN, _LINE_BEGIN, _MATCH = range(6)


@functools.lru_cache(maxsize=128)
def compile_stop_regex(pattern: str) -> StopRegexProgram:
    """The program for ``pattern``; ``ValueError`` if it does not parse, uses a construct
    this engine does not run (named in the message) or is over ``MAX_PROGRAM_SIZE``."""
    try:
        parsed = parse_stop_regex(pattern)
        size = _size(parsed.items) + 1  # + the final MATCH
        if size > MAX_PROGRAM_SIZE:
            raise ValueError(f"the regular expression compiles to {size} NFA states, more "
                             f"than the {MAX_PROGRAM_SIZE} allowed (a large repeat count?)")
        program = StopRegexProgram()
        program.emit(parsed.items, parsed.flags)
        program.push(_MATCH)
    except RecursionError:
        raise ValueError("the regular expression is nested too deeply") from None
    return program


def _size(items: tuple[Node, ...]) -> int:
    """How many instructions ``StopRegexProgram.emit`` makes of ``items`` (kept in step
    with it)."""
    total = 0
    for node in items:
        match node:
            case Group(body=body):
                total += _size(body)
            case Branch(alternatives=alternatives):
                total += sum(map(_size, alternatives)) + 2 * (len(alternatives) - 1)
            case Repeat(low=low, high=high, body=sub):
                body = _size(sub)
                if body == 0:  # repeating nothing is nothing, however many times
                    continue
                tail = body + 2 if high is None else (high - low) * (body + 1)
                total += low * body + tail
            case _:  # a character or an anchor
                total += 1
    return total


class StopRegexProgram:
    """A Thompson NFA: instruction ``pc`` is ``ops[pc]`` with operands ``x[pc]``/``y[pc]``
    and, for ``_CHAR``, ``tests[pc]``. ``_CHAR`` consumes a character passing its test and
    goes on to ``pc + 1``; ``_SPLIT`` goes to both ``x`` and ``y``, ``_JMP`` to ``x``;
    ``_BEGIN``/``_LINE_BEGIN`` go on to ``pc + 1`` only at the text's start (or after a
    newline); ``_MATCH`` accepts. Immutable once compiled: shared by every cursor."""

    def __init__(self) -> None:
        self.ops: list[int] = []
        self.x: list[int] = []
        self.y: list[int] = []
        self.tests: list[Callable[[str], bool] | None] = []

    def cursor(self) -> StopRegexCursor:
        return StopRegexCursor(self)

    def push(self, op: int, test: Callable[[str], bool] | None = None) -> int:
        self.ops.append(op)
        self.x.append(-1)
        self.y.append(-1)
        self.tests.append(test)
        return len(self.ops) - 1

    def emit(self, items: tuple[Node, ...], flags: int) -> None:
        for node in items:
            match node:
                case Group(body=body, add_flags=add_flags, del_flags=del_flags):
                    self.emit(body, (flags | add_flags) & ~del_flags)
                case Branch(alternatives=alternatives):
                    self._emit_branch(alternatives, flags)
                case Repeat(low=low, high=high, body=body):
                    self._emit_repeat(low, high, body, flags)
                case Begin(line=line):
                    self.push(_LINE_BEGIN if line and flags & re.MULTILINE else _BEGIN)
                case _:
                    self.push(_CHAR, char_predicate(node, flags))

    def _emit_branch(self, alternatives: tuple[tuple[Node, ...], ...], flags: int) -> None:
        jumps = []
        for alternative in alternatives[:-1]:
            split = self.push(_SPLIT)
            self.x[split] = split + 1
            self.emit(alternative, flags)
            jumps.append(self.push(_JMP))
            self.y[split] = len(self.ops)
        self.emit(alternatives[-1], flags)
        for jump in jumps:
            self.x[jump] = len(self.ops)

    def _emit_repeat(self, low: int, high: int | None, sub: tuple[Node, ...],
                     flags: int) -> None:
        if _size(sub) == 0:  # else ``(){4000000000}`` would loop for nothing
            return
        for _ in range(low):
            self.emit(sub, flags)
        if high is None:
            loop = self.push(_SPLIT)
            self.x[loop] = loop + 1
            self.emit(sub, flags)
            self.x[self.push(_JMP)] = loop
            self.y[loop] = len(self.ops)
            return
        optional = []
        for _ in range(high - low):  # each further copy may be skipped, to the end
            optional.append(self.push(_SPLIT))
            self.x[optional[-1]] = optional[-1] + 1
            self.emit(sub, flags)
        for split in optional:
            self.y[split] = len(self.ops)


class StopRegexCursor:
    """The Pike VM's state after the characters fed so far (``position`` of them).

    Invariant: ``_pcs``/``_starts`` list the ``_CHAR`` instructions some thread waits at,
    each once, with the leftmost start of a thread there, in nondecreasing start order, so
    that in the next step the first thread to reach an instruction has the leftmost start.
    ``steps`` counts instruction visits: at most ``2 * len(program) + 1`` per character.
    """

    def __init__(self, program: StopRegexProgram):
        self.program = program
        self.position = 0
        self.steps = 0
        self._previous = ""
        self._mark = [-1] * len(program.ops)
        self._pcs: list[int] = []
        self._starts: list[int] = []
        self._close(0, 0, self._pcs, self._starts)

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advances over ``text``; returns ``(start, end)`` of the leftmost-starting match
        that ends within it (ties: the earliest end), in positions of the whole text fed."""
        best: tuple[int, int] | None = None
        tests = self.program.tests
        for ch in text:
            pcs: list[int] = []
            starts: list[int] = []
            self.steps += len(self._pcs)
            self.position += 1
            self._previous = ch
            matched = -1
            for pc, start in zip(self._pcs, self._starts):
                if tests[pc](ch):
                    found = self._close(pc + 1, start, pcs, starts)
                    if matched < 0:
                        matched = found
            self._close(0, self.position, pcs, starts)  # the ``.*?`` before the pattern
            self._pcs, self._starts = pcs, starts
            if matched >= 0 and (best is None or matched < best[0]):
                best = (matched, self.position)
        return best

    def _close(self, pc: int, start: int, pcs: list[int], starts: list[int]) -> int:
        """Follows the non-consuming instructions from ``pc`` at the current position,
        adding the ``_CHAR`` ones not yet reached this step; returns ``start`` if this
        reaches ``_MATCH``, else -1. (``feed`` ignores what the thread started at the
        current position reaches: an empty match, which never counts.)"""
        ops, x, y, mark = self.program.ops, self.program.x, self.program.y, self._mark
        stamp, position = self.position, self.position
        matched = -1
        stack = [pc]
        while stack:
            pc = stack.pop()
            if mark[pc] == stamp:
                continue
            mark[pc] = stamp
            self.steps += 1
            op = ops[pc]
            if op == _CHAR:
                pcs.append(pc)
                starts.append(start)
            elif op == _SPLIT:
                stack.append(y[pc])
                stack.append(x[pc])
            elif op == _JMP:
                stack.append(x[pc])
            elif op == _MATCH:
                matched = start
            elif position == 0 or (op == _LINE_BEGIN and self._previous == "\n"):
                stack.append(pc + 1)
        return matched


# Characters ------------------------------------------------------------------------------

_FOLD_EXTRA = {"\u1fd3": "\u0390", "\u1fe3": "\u03b0", "\ufb05": "\ufb06"}
"""Pairs ``re`` treats as equal under IGNORECASE that simple case mapping does not join."""
_FOLDED_RANGE = 256
"""Ranges up to this long are kept, under IGNORECASE, as the set of their members' folds."""
_SEEN_CHARS = 4096
"""Most characters whose test result one class remembers."""
_ASCII_SPACE = frozenset(" \t\n\r\f\v")


def _one(mapped: str, ch: str) -> str:
    return mapped if len(mapped) == 1 else ch


def fold(ch: str) -> str:
    """The representative of ``ch``'s IGNORECASE class, as ``re`` groups characters: lower
    of upper, so that e.g. 'ſ', 's', 'S' and 'K', 'k', 'K' (Kelvin) share one."""
    upper = _one(ch.upper(), ch)
    lower = upper.lower()[0]  # [0]: 'İ' lowers to 'i' + a combining dot; re keeps the 'i'
    return _FOLD_EXTRA.get(lower, lower)


def _ascii_fold(ch: str) -> str:
    return ch.lower() if ch.isascii() else ch


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


_CATEGORIES: dict[str, tuple[Callable[[str], bool], Callable[[str], bool]]] = {
    # name: (the Unicode test, the test under re.ASCII)
    "digit": (str.isdecimal, lambda ch: "0" <= ch <= "9"),
    "space": (str.isspace, _ASCII_SPACE.__contains__),
    "word": (_is_word, lambda ch: ch.isascii() and _is_word(ch)),
}


def char_predicate(node: Literal | AnyChar | CharSet, flags: int) -> Callable[[str], bool]:
    """The test of one character for a consuming node of a parsed pattern."""
    if isinstance(node, AnyChar):
        return _always if flags & re.DOTALL else "\n".__ne__
    if isinstance(node, CharSet):
        return CharClass(node, flags)
    folder = _case_folder(flags)
    if folder is None:
        return node.char.__eq__
    key = folder(node.char)
    return lambda ch: folder(ch) == key


def _always(ch: str) -> bool:
    return True


def _case_folder(flags: int) -> Callable[[str], str] | None:
    if not flags & re.IGNORECASE:
        return None
    return _ascii_fold if flags & re.ASCII else fold


class CharClass:
    """A ``[...]`` class (or ``\\d``, ``\\w``, ``\\s``). Under IGNORECASE a member matches
    its whole case class: literals and ranges of up to ``_FOLDED_RANGE`` characters are
    kept as the set of their folds, as ``re`` does; a longer range matches a character when
    the character, its fold or the fold's upper case lies in it (``re`` also joins the rare
    third case forms, e.g. 's' for a long range holding 'ſ' but neither 's' nor 'S')."""

    def __init__(self, char_set: CharSet, flags: int):
        self.negate = char_set.negated
        self.folder = _case_folder(flags)
        fold_key = self.folder or (lambda ch: ch)
        chars = set()
        self.ranges: list[tuple[str, str]] = []
        self.categories: list[Callable[[str], bool]] = []
        ascii_only = 1 if flags & re.ASCII else 0
        for member in char_set.members:
            match member:
                case Literal(char=char):
                    chars.add(fold_key(char))
                case CharRange(low=low, high=high) if (
                        self.folder and ord(high) - ord(low) < _FOLDED_RANGE):
                    chars.update(self.folder(chr(point))
                                 for point in range(ord(low), ord(high) + 1))
                case CharRange(low=low, high=high):
                    self.ranges.append((low, high))
                case Category(name=name, negated=False):
                    self.categories.append(_CATEGORIES[name][ascii_only])
                case Category(name=name, negated=True):
                    test = _CATEGORIES[name][ascii_only]
                    self.categories.append(lambda ch, test=test: not test(ch))
        self.chars = frozenset(chars)
        self._seen: dict[str, bool] = {}  # outputs reuse few characters: test each once

    def __call__(self, ch: str) -> bool:
        known = self._seen.get(ch)
        if known is None:
            known = self._test(ch)
            if len(self._seen) < _SEEN_CHARS:
                self._seen[ch] = known
        return known

    def _test(self, ch: str) -> bool:
        key = self.folder(ch) if self.folder else ch
        hit = key in self.chars or any(test(ch) for test in self.categories)
        if not hit and self.ranges:
            forms = (ch,)
            if self.folder is fold:
                forms = (ch, key, _one(key.upper(), key))
            elif self.folder is not None and ch.isascii():
                forms = (ch, ch.lower(), ch.upper())
            hit = any(lo <= form <= hi for lo, hi in self.ranges for form in forms)
        return hit != self.negate
