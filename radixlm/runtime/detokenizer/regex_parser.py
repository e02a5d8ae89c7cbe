"""The syntax of a stop regex, parsed into a small tree that ``stop_regex`` compiles.

``re``'s own parser (``re._parser``, once ``sre_parse``) is private and changes between
Python releases, so stop regexes are parsed here. The syntax is ``re``'s for ``str``
patterns as of Python 3.11, restricted to what runs in linear time:

- a pattern ``re`` rejects is rejected: ``ValueError("not a valid regular expression:
  ...")`` with ``re``'s reason and position;
- a construct that needs backtracking or the text after the match (backreferences,
  lookaround, conditionals, atomic groups, possessive repeats, ``$``, ``\\Z``, ``\\b``,
  ``\\B``) is refused by name: ``ValueError("... is not supported in a stop regex")``;
- everything else parses to a tree that matches what ``re`` matches. Lazy and greedy
  repeats match the same substrings, so the tree does not tell them apart; groups that
  neither capture for a repeat nor change flags are flattened into their sequence.

The tree's node types are ``regex_syntax.py``'s.
"""

from __future__ import annotations

import re
import unicodedata

from radixlm.runtime.detokenizer.regex_syntax import (
    MAX_REPEAT_COUNT,
    AnyChar,
    Begin,
    Category,
    CharRange,
    CharSet,
    Group,
    Literal,
    Node,
    ParsedRegex,
    Repeat,
    merge_alternatives,
)


def parse_stop_regex(pattern: str) -> ParsedRegex:
    """The tree of ``pattern``; ``ValueError`` if ``re`` would reject it or it uses a
    construct that a stop regex may not (named in the message)."""
    parser = _Parser(pattern)
    items = parser.alternation(verbose=False, top=True)
    if parser.pos < len(pattern):  # alternation stops only at the end or at a ')'
        raise parser.error("unbalanced parenthesis")
    if parser.flags & re.ASCII and parser.flags & re.UNICODE:
        raise parser.error("ASCII and UNICODE flags are incompatible")
    return ParsedRegex(items, parser.flags)


_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE,
          "a": re.ASCII, "u": re.UNICODE, "L": re.LOCALE}
_TYPE_FLAGS = re.ASCII | re.UNICODE | re.LOCALE
_CATEGORIES = {"d": Category("digit"), "s": Category("space"), "w": Category("word"),
               "D": Category("digit", True), "S": Category("space", True),
               "W": Category("word", True)}
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            "\\": "\\"}
_REFUSED_ESCAPES = {"b": "the word boundary \\b", "B": "the non-boundary \\B",
                    "Z": "the end anchor \\Z"}
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_OCT_DIGITS = frozenset("01234567")
_DIGITS = frozenset("0123456789")
_WHITESPACE = frozenset(" \t\n\r\v\f")
_GLOBAL_FLAGS = object()
"""What ``_Parser.group`` returns for ``(?flags)``: no node, the whole pattern's flags."""


class _Parser:
    """A recursive descent over ``pattern``; ``pos`` is the next character to read."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.pos = 0
        self.flags = 0
        self.group_names: set[str] = set()

    def error(self, message: str, at: int | None = None) -> ValueError:
        position = self.pos if at is None else at
        return ValueError(f"not a valid regular expression: {message} at position {position}")

    @staticmethod
    def refuse(what: str) -> ValueError:
        return ValueError(f"{what} is not supported in a stop regex")

    def peek(self) -> str:
        return self.pattern[self.pos:self.pos + 1]

    def take(self) -> str:
        """The next character ('' at the end)."""
        ch = self.pattern[self.pos:self.pos + 1]
        self.pos += len(ch)
        return ch

    def accept(self, ch: str) -> bool:
        if self.peek() == ch:
            self.pos += 1
            return True
        return False

    def take_while(self, limit: int, allowed: frozenset[str]) -> str:
        start = self.pos
        while self.pos - start < limit and self.peek() and self.peek() in allowed:
            self.pos += 1
        return self.pattern[start:self.pos]

    def take_token(self) -> str:
        """The next character, or an escape with the character it escapes (how ``re``
        reads comments and names: a ``\\)`` does not close ``(?#...)``)."""
        ch = self.take()
        if ch == "\\":
            escaped = self.take()
            if not escaped:
                raise self.error("bad escape (end of pattern)", self.pos - 1)
            ch += escaped
        return ch

    # Structure --------------------------------------------------------------------------

    def alternation(self, verbose: bool, top: bool) -> tuple[Node, ...]:
        alternatives = []
        while True:
            alternatives.append(self.sequence(verbose, first=top and not alternatives))
            if not self.accept("|"):
                break
            if top:
                verbose = bool(self.flags & re.VERBOSE)
        return merge_alternatives(alternatives)

    def sequence(self, verbose: bool, first: bool) -> tuple[Node, ...]:
        items: list[Node] = []
        while (ch := self.peek()) not in ("", "|", ")"):
            start = self.pos
            self.pos += 1
            if verbose and ch in _WHITESPACE:
                continue
            if verbose and ch == "#":
                while self.peek() and self.take_token() != "\n":
                    pass
            elif ch == "\\":
                items.append(self.escape())
            elif ch == "[":
                items.append(self.char_set(start))
            elif ch in "*+?{":
                self.repeat(ch, items, start)
            elif ch == ".":
                items.append(AnyChar())
            elif ch == "^":
                items.append(Begin(line=True))
            elif ch == "$":
                raise self.refuse("the end anchor $")
            elif ch == "(":
                node = self.group(verbose, first and not items, start)
                if node is _GLOBAL_FLAGS:
                    verbose = bool(self.flags & re.VERBOSE)
                elif node is not None:
                    items.append(node)
            else:
                items.append(Literal(ch))
        flat: list[Node] = []
        for item in items:
            if isinstance(item, Group) and not (item.add_flags or item.del_flags):
                flat.extend(item.body)
            else:
                flat.append(item)
        return tuple(flat)

    def repeat(self, ch: str, items: list[Node], start: int) -> None:
        if ch == "{":
            bounds = self.repeat_bounds()
            if bounds is None:  # not a repeat: a literal '{'
                items.append(Literal("{"))
                return
            low, high = bounds
        else:
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if not items or isinstance(items[-1], Begin):
            raise self.error("nothing to repeat", start)
        if isinstance(items[-1], Repeat):
            raise self.error("multiple repeat", start)
        if self.accept("+"):
            raise self.refuse("a possessive repeat (*+, ++, ?+, {m,n}+)")
        self.accept("?")  # lazy: matches the same substrings
        item = items[-1]
        flagless = isinstance(item, Group) and not (item.add_flags or item.del_flags)
        items[-1] = Repeat(low, high, item.body if flagless else (item,))

    def repeat_bounds(self) -> tuple[int, int | None] | None:
        """``{m}``, ``{m,}``, ``{,n}`` or ``{m,n}`` after the '{', or None (and nothing
        read) where what follows is not one."""
        here = self.pos
        if self.peek() == "}":
            return None
        low = self.take_while(len(self.pattern), _DIGITS)
        high = self.take_while(len(self.pattern), _DIGITS) if self.accept(",") else low
        if not self.accept("}"):
            self.pos = here
            return None
        bounds = (int(low) if low else 0, int(high) if high else None)
        if any(count is not None and count > MAX_REPEAT_COUNT for count in bounds):
            raise self.error("the repetition number is too large", here)
        if bounds[1] is not None and bounds[1] < bounds[0]:
            raise self.error("min repeat greater than max repeat", here)
        return bounds

    def group(self, verbose: bool, first: bool, start: int) -> Node | object | None:
        """The node of the group opened at ``start``; None for a comment, ``_GLOBAL_FLAGS``
        for ``(?flags)`` (added to ``self.flags``)."""
        add_flags = del_flags = 0
        if self.accept("?"):
            ch = self.take()
            if not ch:
                raise self.error("unexpected end of pattern")
            if ch == "P":
                if self.accept("<"):
                    self.group_name(">", define=True)
                elif self.accept("="):
                    self.group_name(")", define=False)
                    raise self.refuse("a backreference (?P=name)")
                else:
                    other = self.take()
                    raise self.error(f"unknown extension ?P{other}" if other
                                     else "unexpected end of pattern")
            elif ch == "#":
                while self.peek():
                    if self.take_token() == ")":
                        return None
                raise self.error("missing ), unterminated comment", start)
            elif ch == "=":
                raise self.refuse("a lookahead (?=...)")
            elif ch == "!":
                raise self.refuse("a negative lookahead (?!...)")
            elif ch == "<":
                other = self.take()
                if other not in ("=", "!"):
                    raise self.error(f"unknown extension ?<{other}" if other
                                     else "unexpected end of pattern")
                raise self.refuse("a lookbehind (?<=...)" if other == "="
                                  else "a negative lookbehind (?<!...)")
            elif ch == "(":
                raise self.refuse("a conditional group (?(...)...)")
            elif ch == ">":
                raise self.refuse("an atomic group (?>...)")
            elif ch in _FLAGS or ch == "-":
                scoped = self.inline_flags(ch)
                if scoped is None:
                    if not first:
                        raise self.error("global flags not at the start of the expression",
                                         start)
                    return _GLOBAL_FLAGS
                add_flags, del_flags = scoped
            elif ch != ":":
                raise self.error(f"unknown extension ?{ch}", self.pos - 1)
        verbose = bool((verbose or add_flags & re.VERBOSE) and not del_flags & re.VERBOSE)
        body = self.alternation(verbose, top=False)
        if not self.accept(")"):
            raise self.error("missing ), unterminated subpattern", start)
        return Group(body, add_flags, del_flags)

    def group_name(self, terminator: str, define: bool) -> None:
        start = self.pos
        name = ""
        while (token := self.take_token()) != terminator:
            if not token:
                raise self.error(f"missing {terminator}, unterminated name", start)
            name += token
        if not name.isidentifier():
            raise self.error(f"bad character in group name {name!r}", start)
        if define and name in self.group_names:
            raise self.error(f"redefinition of group name {name!r}", start)
        self.group_names.add(name)

    def inline_flags(self, ch: str) -> tuple[int, int] | None:
        """The flags of ``(?aiLmsux-imsx:`` from its first flag ``ch`` on: (added,
        removed), or None for ``(?aiLmsux)`` (whole-pattern flags, added to ``flags``)."""
        add_flags = del_flags = 0
        if ch != "-":
            while True:
                if ch == "L":
                    raise self.error("bad inline flags: cannot use 'L' flag with a str pattern")
                add_flags |= _FLAGS[ch]
                if _FLAGS[ch] & _TYPE_FLAGS and add_flags & _TYPE_FLAGS != _FLAGS[ch]:
                    raise self.error("bad inline flags: flags 'a', 'u' and 'L' are incompatible")
                ch = self.take()
                if ch in (")", "-", ":"):
                    break
                if ch not in _FLAGS:
                    raise self.error("unknown flag" if ch.isalpha() else "missing -, : or )")
            if ch == ")":
                self.flags |= add_flags
                return None
        if ch == "-":
            ch = self.take()
            while True:
                if ch not in _FLAGS:
                    raise self.error("unknown flag" if ch.isalpha() else "missing flag or :")
                if _FLAGS[ch] & _TYPE_FLAGS:
                    raise self.error("bad inline flags: cannot turn off flags 'a', 'u' and 'L'")
                del_flags |= _FLAGS[ch]
                ch = self.take()
                if ch == ":":
                    break
        if add_flags & del_flags:
            raise self.error("bad inline flags: flag turned on and off")
        return add_flags, del_flags

    # Characters -------------------------------------------------------------------------

    def escape(self) -> Node:
        """The node of an escape outside brackets, after its backslash."""
        ch = self.take()
        if not ch:
            raise self.error("bad escape (end of pattern)", self.pos - 1)
        if ch in _CATEGORIES:
            return CharSet((_CATEGORIES[ch],))
        if ch == "A":
            return Begin(line=False)
        if ch in _REFUSED_ESCAPES:
            raise self.refuse(_REFUSED_ESCAPES[ch])
        if ch in _DIGITS and ch != "0":
            digits = ch + self.take_while(1, _DIGITS)
            if len(digits) == 2 and set(digits) <= _OCT_DIGITS and self.peek() in _OCT_DIGITS:
                return self.octal(digits + self.take())
            raise self.refuse(f"a backreference \\{digits}")
        return self.char_escape(ch, in_class=False)

    def class_escape(self) -> Literal | Category:
        """A member of ``[...]`` written as an escape, after its backslash."""
        ch = self.take()
        if not ch:
            raise self.error("bad escape (end of pattern)", self.pos - 1)
        if ch in _ESCAPES:  # first: ``\\b`` is a backspace here
            return Literal(_ESCAPES[ch])
        if ch in _CATEGORIES:
            return _CATEGORIES[ch]
        return self.char_escape(ch, in_class=True)

    def char_escape(self, ch: str, in_class: bool) -> Literal:
        """One character written as an escape: ``ch`` is what follows the backslash."""
        start = self.pos - 2
        if ch in _ESCAPES:
            return Literal(_ESCAPES[ch])
        if ch in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits = self.take_while(width, _HEX_DIGITS)
            if len(digits) != width:
                raise self.error(f"incomplete escape \\{ch}{digits}", start)
            if int(digits, 16) > 0x10FFFF:
                raise self.error(f"bad escape \\{ch}{digits}", start)
            return Literal(chr(int(digits, 16)))
        if ch == "N":
            if not self.accept("{"):
                raise self.error("missing {")
            end = self.pattern.find("}", self.pos)
            if end <= self.pos:
                raise self.error("missing }, unterminated character name" if end < 0
                                 else "missing character name")
            name, self.pos = self.pattern[self.pos:end], end + 1
            try:
                return Literal(unicodedata.lookup(name))
            except KeyError:
                raise self.error(f"undefined character name {name!r}", start) from None
        if ch in _OCT_DIGITS and (in_class or ch == "0"):
            return self.octal(ch + self.take_while(2, _OCT_DIGITS))
        if ch.isascii() and (ch.isalpha() or ch.isdigit()):
            raise self.error(f"bad escape \\{ch}", start)
        return Literal(ch)

    def octal(self, digits: str) -> Literal:
        if int(digits, 8) > 0o377:
            raise self.error(f"octal escape value \\{digits} outside of range 0-0o377",
                             self.pos - len(digits) - 1)
        return Literal(chr(int(digits, 8)))

    def char_set(self, start: int) -> Node:
        """``[...]`` after its '['; a class of one literal is that literal."""
        negated = self.accept("^")
        members: list[Literal | CharRange | Category] = []
        while True:
            ch = self.take()
            if not ch:
                raise self.error("unterminated character set", start)
            if ch == "]" and members:
                break
            first = self.class_escape() if ch == "\\" else Literal(ch)
            if not self.accept("-"):
                members.append(first)
                continue
            other = self.take()
            if not other:
                raise self.error("unterminated character set", start)
            if other == "]":
                members += [first, Literal("-")]
                break
            last = self.class_escape() if other == "\\" else Literal(other)
            if not (isinstance(first, Literal) and isinstance(last, Literal)
                    and first.char <= last.char):
                raise self.error("bad character range", start)
            members.append(CharRange(first.char, last.char))
        unique = tuple(dict.fromkeys(members))
        if len(unique) == 1 and isinstance(unique[0], Literal) and not negated:
            return unique[0]
        return CharSet(unique, negated)
