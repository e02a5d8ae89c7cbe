"""The tree a stop regex parses to (``regex_parser.py``), which ``stop_regex`` compiles.

A sequence is a tuple of nodes. Flags are kept where ``re`` keeps them: those of the whole
pattern (``re.I``, ``re.M``, ``re.S``, ``re.X``, ``re.A``, ``re.U``) on ``ParsedRegex``,
scoped ones (``(?i:...)``) on a ``Group``; a character test reads them when compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REPEAT_COUNT = 2**32 - 2
"""The largest ``{m,n}`` count ``re`` accepts (``re`` rejects counts of 2^32 - 1 and up)."""


@dataclass(frozen=True, slots=True)
class Literal:
    char: str


@dataclass(frozen=True, slots=True)
class AnyChar:
    """``.``: any character but a newline (any at all under ``re.DOTALL``)."""


@dataclass(frozen=True, slots=True)
class CharRange:
    low: str
    high: str


@dataclass(frozen=True, slots=True)
class Category:
    """``\\d``, ``\\s`` or ``\\w`` (``name`` "digit", "space" or "word"), or, ``negated``,
    ``\\D``, ``\\S`` or ``\\W``."""

    name: str
    negated: bool = False


@dataclass(frozen=True, slots=True)
class CharSet:
    """``[...]`` (``negated``: ``[^...]``), or a category escape outside brackets."""

    members: tuple[Literal | CharRange | Category, ...]
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Begin:
    """``^`` (``line``: it also holds after a newline under ``re.MULTILINE``) or ``\\A``."""

    line: bool


@dataclass(frozen=True, slots=True)
class Group:
    """A group kept as one node: a capturing group until a repeat takes its body, or one
    that changes flags for its body (``(?i:...)``, ``(?-s:...)``)."""

    body: tuple[Node, ...]
    add_flags: int = 0
    del_flags: int = 0


@dataclass(frozen=True, slots=True)
class Branch:
    alternatives: tuple[tuple[Node, ...], ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    """``body`` ``low`` to ``high`` times (``high`` None: unbounded)."""

    low: int
    high: int | None
    body: tuple[Node, ...]


Node = Literal | AnyChar | CharSet | Begin | Group | Branch | Repeat


@dataclass(frozen=True, slots=True)
class ParsedRegex:
    items: tuple[Node, ...]
    flags: int
    """The flags of the whole pattern, set by ``(?aimsux)`` at its start."""


def merge_alternatives(alternatives: list[tuple[Node, ...]]) -> tuple[Node, ...]:
    """``a|b|...`` as ``re`` reduces it: a prefix common to every alternative is taken out,
    and alternatives of one character each become one class (fewer NFA states)."""
    if len(alternatives) == 1:
        return alternatives[0]
    prefix: list[Node] = []
    while all(alternatives) and all(alt[0] == alternatives[0][0] for alt in alternatives):
        prefix.append(alternatives[0][0])
        alternatives = [alt[1:] for alt in alternatives]
    members: list[Literal | CharRange | Category] = []
    for alternative in alternatives:
        if len(alternative) != 1:
            break
        [node] = alternative
        if isinstance(node, Literal):
            members.append(node)
        elif isinstance(node, CharSet) and not node.negated:
            members.extend(node.members)
        else:
            break
    else:
        return (*prefix, CharSet(tuple(dict.fromkeys(members))))
    return (*prefix, Branch(tuple(alternatives)))
