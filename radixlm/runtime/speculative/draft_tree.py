"""A request's draft: tokens that may follow its last token, as a chain or a token tree.

Node ``i`` holds ``tokens[i]``; its parent is ``parents[i]``: -1 for the request's last
token (the root, which every verify checks), else an earlier node. Invariants:

- ``parents[i] < i`` (every node comes after its parent: preorder), and siblings hold
  different tokens (a trie: a position's chosen token picks at most one child);
- the first node of every branch is listed first among its siblings' subtrees, and the
  *main chain* (node 0, its first child, that one's first child, ...) is nodes
  ``0 .. main_length - 1``: a chain is a tree whose main chain is all of it;
- cutting the list at any length leaves a tree (``truncate``): the nodes cut are the last
  in preorder, whose parents stay.

A verify pass checks every node at position ``kv_len + depth`` (the root at depth 0), each
seeing the prefix and its own ancestors only; a request then follows the tree from the root
while its chosen token is one of the children's (``child``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> Draft:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @classmethod
    def from_branches(cls, branches: Sequence[Sequence[int]], max_nodes: int) -> Draft:
        """The trie of ``branches`` (in order of preference: the first begins the main
        chain) with at most ``max_nodes`` nodes, filled level by level: all branches'
        first tokens, then their second ones, ... (in order of preference within a level),
        so that one branch alone goes as deep as the budget allows and several share it."""
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        order: list[tuple[int, int]] = []  # (parent, token), in insertion order
        ends = [-1] * len(branches)  # each branch's node at the level above
        for depth in range(max((len(b) for b in branches), default=0)):
            for number, branch in enumerate(branches):
                if depth >= len(branch):
                    continue
                key = (ends[number], branch[depth])
                node = children.get(key)
                if node is None:
                    if len(order) == max_nodes:
                        return cls._preorder(order)
                    node = children[key] = len(order)
                    order.append(key)
                ends[number] = node
        return cls._preorder(order)

    @classmethod
    def _preorder(cls, nodes: list[tuple[int, int]]) -> Draft:
        """The tree of ``nodes`` ((parent, token), parents first) renumbered in preorder,
        children in the order they were added (so the first branch is the main chain)."""
        below: dict[int, list[int]] = {}
        for node, (parent, _) in enumerate(nodes):
            below.setdefault(parent, []).append(node)
        draft, number = cls(), {-1: -1}
        stack = list(reversed(below.get(-1, [])))
        while stack:
            node = stack.pop()
            parent, token = nodes[node]
            number[node] = len(draft.tokens)
            draft.tokens.append(token)
            draft.parents.append(number[parent])
            stack.extend(reversed(below.get(node, [])))
        return draft

    def __len__(self) -> int:
        return len(self.tokens)

    def __bool__(self) -> bool:
        return bool(self.tokens)

    @property
    def main_length(self) -> int:
        """Nodes of the main chain (the first ``main_length`` nodes)."""
        length = 0
        while length < len(self.parents) and self.parents[length] == length - 1:
            length += 1
        return length

    def branch_starts(self) -> list[int]:
        """The nodes off the main chain that do not follow their parent in the list: each
        begins a branch that a verify pass gives a request row of its own."""
        return [node for node in range(self.main_length, len(self.parents))
                if self.parents[node] != node - 1]

    def is_chain(self) -> bool:
        return self.main_length == len(self.tokens)

    def truncate(self, length: int) -> None:
        """Keeps the first ``length`` nodes (a tree still: see the module)."""
        del self.tokens[length:]
        del self.parents[length:]

    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` (-1: the root) that holds ``token``, if any."""
        for candidate in range(node + 1, len(self.tokens)):
            if self.parents[candidate] == node and self.tokens[candidate] == token:
                return candidate
        return None

    def keep(self, kept: Sequence[bool]) -> None:
        """Keeps the nodes ``kept`` marks (a node whose parent goes goes too), in order."""
        number: dict[int, int] = {-1: -1}
        tokens, parents = [], []
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if kept[node] and parent in number:
                number[node] = len(tokens)
                tokens.append(token)
                parents.append(number[parent])
        self.tokens, self.parents = tokens, parents
