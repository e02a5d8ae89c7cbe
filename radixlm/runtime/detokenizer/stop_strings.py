"""Stop strings matched with an Aho–Corasick automaton, in time linear in the new text.

Searching each stop string in a window of the text after every token costs (number of
stops) x (longest stop) per token, and so does asking which text to hold back; a request
with thousands of long stop strings stalls every request of the batch. The automaton is
built once per stop list (linear in its total length; shared by requests with the same
list), and a cursor per request advances over each new character in amortised constant
time, whatever the number of stops (Aho and Corasick, "Efficient string matching: an aid
to bibliographic search", CACM 1975).

A cursor's state is the trie node of the longest suffix of the text fed so far that is a
prefix of some stop string. From it, in constant time: the longest stop string ending at
the last character (the leftmost-starting one), and ``held``, the longest suffix that is a
proper prefix of a stop string (text that could still become a stop, not to be shown yet).
"""

from __future__ import annotations

import functools
from array import array
from collections import deque

_CODE_SPAN = 0x110000
"""Code points per node in the keys of ``_branches`` (node * span + code point)."""


@functools.lru_cache(maxsize=32)
def stop_string_automaton(stops: tuple[str, ...]) -> StopStringAutomaton:
    """The automaton for ``stops``, shared between requests with the same stop list."""
    return StopStringAutomaton(stops)


class StopStringAutomaton:
    """The trie of the stop strings, with failure links; immutable once built.

    Node 0 is the root; a node's number is larger than its parent's. Nodes live in arrays
    rather than objects, because a trie of long stop strings is mostly single-child
    chains: the child that a string's insertion created right after its parent is
    ``parent + 1`` (checked by ``_parent``/``_code``), and only the other children, at most
    one per stop string, sit in the ``_branches`` dict. Per node:

    - ``_fail``: the node of the longest proper suffix of this node's string in the trie;
    - ``_match``: the index in ``stops`` of the longest stop string that is a suffix of
      this node's string (itself, or found through ``_fail``), or -1;
    - ``_held``: the depth of the deepest node on this node's ``_fail`` chain (itself
      included) that has children, i.e. the longest suffix that is a proper prefix.
    """

    def __init__(self, stops: tuple[str, ...]):
        if not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self._parent = array("i", [0])
        self._code = array("i", [-1])
        self._depth = array("i", [0])
        self._match = array("i", [-1])
        self._held = array("i", [0])  # depth for nodes with children until linked
        self._branches: dict[int, int] = {}
        self._branched: dict[int, list[int]] = {}  # the ``_branches`` children, while building
        for index, stop in enumerate(stops):
            self._insert(index, stop)
        self._fail = array("i", bytes(4 * len(self._parent)))
        self._link()

    def cursor(self) -> StopStringCursor:
        return StopStringCursor(self)

    def step(self, node: int, code: int) -> tuple[int, int]:
        """(the node after feeding code point ``code`` at ``node``, the failure links
        followed to get there)."""
        parent, codes, branches = self._parent, self._code, self._branches
        last = len(parent) - 1
        hops = 0
        while True:
            if node < last and parent[node + 1] == node and codes[node + 1] == code:
                return node + 1, hops
            nxt = branches.get(node * _CODE_SPAN + code, -1)
            if nxt >= 0:
                return nxt, hops
            if node == 0:
                return 0, hops
            node = self._fail[node]
            hops += 1

    def _insert(self, index: int, stop: str) -> None:
        parent, code, depth, held = self._parent, self._code, self._depth, self._held
        node = 0
        for ch in stop:
            point = ord(ch)
            if node < len(parent) - 1 and parent[node + 1] == node and code[node + 1] == point:
                node += 1
                continue
            nxt = self._branches.get(node * _CODE_SPAN + point, -1)
            if nxt < 0:
                nxt = len(parent)
                if nxt != node + 1:
                    self._branches[node * _CODE_SPAN + point] = nxt
                    self._branched.setdefault(node, []).append(nxt)
                held[node] = depth[node]
                parent.append(node)
                code.append(point)
                depth.append(depth[node] + 1)
                self._match.append(-1)
                held.append(0)
            node = nxt
        if self._match[node] < 0:  # a repeated stop string keeps its first index
            self._match[node] = index

    def _link(self) -> None:
        """Sets ``_fail``, ``_match`` and ``_held`` breadth first: a node's values need only
        those of shallower nodes. Following failure links costs, over one stop string's
        nodes, at most its length (the depth of the failure node grows by at most one per
        character), so the whole is linear in the total length of the stops."""
        parent, code, fail = self._parent, self._code, self._fail
        match, held, branched = self._match, self._held, self._branched
        last = len(parent) - 1
        queue = deque([1, *branched.get(0, ())] if last else ())
        while queue:
            node = queue.popleft()
            up = parent[node]
            if up:  # a child of the root fails to the root (``fail`` starts zeroed)
                fail[node] = self.step(fail[up], code[node])[0]
            if match[node] < 0:
                match[node] = match[fail[node]]
            if held[node] == 0:  # a leaf: a whole stop string, held no longer
                held[node] = held[fail[node]]
            if node < last and parent[node + 1] == node:
                queue.append(node + 1)
            if node in branched:
                queue.extend(branched[node])
        branched.clear()


class StopStringCursor:
    """One request's position in a ``StopStringAutomaton``: the node reached by the
    characters fed so far (``position`` of them). ``steps`` counts transitions and failure
    links followed: at most twice the characters fed."""

    def __init__(self, automaton: StopStringAutomaton):
        self.automaton = automaton
        self.node = 0
        self.position = 0
        self.steps = 0

    def feed(self, text: str) -> tuple[int, int, str] | None:
        """Advances over ``text``; returns ``(start, end, stop)`` of the leftmost-starting
        stop string that ends within it (ties: the earliest end), in positions of the whole
        text fed."""
        automaton = self.automaton
        stops, match = automaton.stops, automaton._match
        best: tuple[int, int, str] | None = None
        node, position = self.node, self.position
        for ch in text:
            node, hops = automaton.step(node, ord(ch))
            self.steps += hops + 1
            position += 1
            index = match[node]
            if index >= 0:
                stop = stops[index]
                if best is None or position - len(stop) < best[0]:
                    best = (position - len(stop), position, stop)
        self.node, self.position = node, position
        return best

    @property
    def held(self) -> int:
        """The longest suffix of the text fed that is a proper prefix of a stop string."""
        return self.automaton._held[self.node]
