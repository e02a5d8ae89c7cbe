"""``s``: the state a program writes to, and the group of states ``s.fork(n)`` returns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.frontend_lang import ir
from radixlm.frontend_lang.executor import Executor, ProgramError


class ProgramState:
    """What a program has produced so far; ``s += expr`` appends, ``s[name]`` reads a
    variable (waiting until it is set)."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> ProgramState:
        self._executor.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        try:
            self._executor.get_var(name)
        except KeyError:
            return False
        return True

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def text(self) -> str:
        self._executor.sync()
        return self._executor.text

    def messages(self) -> list[dict[str, str]]:
        """The finished role turns, as chat messages."""
        self._executor.sync()
        return [dict(message) for message in self._executor.messages]

    def get_meta_info(self, name: str) -> Any:
        """The ``meta_info`` of the ``gen`` or ``select`` that set ``name`` (after a join,
        a list with one entry per branch)."""
        self._executor.get_var(name)
        return self._executor.meta_info.get(name)

    def sync(self) -> None:
        self._executor.sync()

    def error(self) -> BaseException | None:
        """What made the program fail, or ``None``."""
        return self._executor.error

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """``size`` copies of this state; with ``size > 1`` the common prefix is cached
        before the branches run."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"fork size must be a positive integer, got {size!r}")
        children = self._executor.fork(size)
        return ProgramStateGroup([ProgramState(child) for child in children], self)

    def copy(self) -> ProgramState:
        return self.fork(1)[0]

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """The text appended inside the ``with`` block becomes variable ``name``."""
        self._executor.submit(ir.VarScopeBegin(name))
        yield
        self._executor.submit(ir.VarScopeEnd(name))

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    def _role(self, role: str, expr: Any) -> Any:
        if expr is not None:
            self += ir.RoleBegin(role) + expr + ir.RoleEnd(role)
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._executor.submit(ir.RoleBegin(role))
        yield
        self._executor.submit(ir.RoleEnd(role))

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or variable ``var_name``) piece by piece as it is generated; without
        ``stream=True`` in ``run``, in one piece at the end."""
        if var_name is not None and not isinstance(var_name, str):
            raise TypeError(f"var_name must be a str, got {type(var_name).__name__}")
        seen = 0
        while True:
            piece, done = self._executor.wait_text(var_name, seen)
            if piece:
                seen += len(piece)
                yield piece
            if done:
                return

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """``text_iter`` for asyncio code: the waiting happens on a worker thread."""
        iterator = self.text_iter(var_name)
        done = object()
        while True:
            piece = await asyncio.to_thread(next, iterator, done)
            if piece is done:
                return
            if return_meta_data and var_name is not None:
                yield piece, self._executor.meta_info.get(var_name)
            else:
                yield piece

    def __repr__(self) -> str:
        return f"ProgramState({self._executor.text[-200:]!r})"


class ProgramStateGroup:
    """The branches of a fork; ``+=`` appends to every branch (a callable gets the branch
    index, a list gives one item per branch)."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self._parent = parent

    def __getitem__(self, index: int) -> ProgramState:
        return self.states[index]

    def __setitem__(self, index: int, state: ProgramState) -> None:
        """Only what ``forks[i] += expr`` does: put branch i's own state back."""
        if state is not self.states[index]:
            raise TypeError("a fork's branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, list):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} items for {len(self.states)} branches")
            items: Callable[[int], Any] = other.__getitem__
        elif callable(other) and not isinstance(other, ir.Expr):
            items = other
        else:
            items = lambda _index: other  # noqa: E731
        for index, state in enumerate(self.states):
            state += items(index)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Waits for every branch. ``gather_variable``: each variable set in the branches
        becomes, in the parent, the list of its values; ``concate_and_append``: the
        branches' new text is appended to the parent, in branch order."""
        self._parent._executor.join([state._executor for state in self.states], mode)


__all__ = ["ProgramError", "ProgramState", "ProgramStateGroup"]
