"""Tracing: run a program with unknown arguments to find the text every run starts with.

``run_batch`` caches that constant prefix once before its items run, so the items hit the
radix cache instead of racing to compute the same prefix. Tracing appends literal text and
role markup and stops at the first thing whose text is not known in advance: a ``gen``, a
``select``, an argument, a variable read, a fork. Whatever the program does after that
point (including raising) does not matter.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.frontend_lang import ir
from radixlm.frontend_lang.chat_template import ChatTemplate


@dataclass
class ProgramTrace:
    """The constant prefix of a program and the expressions that make it up."""

    prefix: str = ""
    exprs: list[ir.Expr] = field(default_factory=list)
    stopped_at: str = "the end of the program"


class TracingState:
    """Stands in for ``s`` while tracing."""

    def __init__(self, template: ChatTemplate) -> None:
        self._template = template
        self._trace = ProgramTrace()
        self._roles_seen = 0

    def __iadd__(self, other: Any) -> TracingState:
        for expr in ir.flatten(ir.as_expr(other)):
            if isinstance(expr, ir.Constant):
                self._trace.prefix += expr.text
            elif isinstance(expr, ir.RoleBegin):
                self._trace.prefix += self._template.begin(expr.role, self._roles_seen == 0)
                self._roles_seen += 1
            elif isinstance(expr, ir.RoleEnd):
                self._trace.prefix += self._template.end(expr.role)
            else:
                raise ir.TracingStop(type(expr).__name__)
            self._trace.exprs.append(expr)
        return self

    def system(self, expr: Any = None) -> None:
        self._role("system", expr)

    def user(self, expr: Any = None) -> None:
        self._role("user", expr)

    def assistant(self, expr: Any = None) -> None:
        self._role("assistant", expr)

    def _role(self, role: str, expr: Any) -> None:
        if expr is None:
            raise ir.TracingStop(f"s.{role}() as a block")
        self.__iadd__(ir.RoleBegin(role) + expr + ir.RoleEnd(role))

    def __getattr__(self, name: str) -> Any:
        # s.fork(), s["x"], s.text(), s.user(...): the text is no longer known in advance.
        raise ir.TracingStop(f"s.{name}")

    def __getitem__(self, name: str) -> Any:
        raise ir.TracingStop(f"s[{name!r}]")


def trace_program(func: Callable[..., Any], bound: dict[str, Any],
                  template: ChatTemplate) -> ProgramTrace:
    """Runs ``func`` with ``bound`` arguments and placeholders for the others."""
    parameters = list(inspect.signature(func).parameters.values())[1:]
    arguments = {
        p.name: bound.get(p.name, ir.Argument(p.name)) for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    state = TracingState(template)
    try:
        func(state, **arguments)
    except ir.TracingStop as stop:
        state._trace.stopped_at = str(stop)
    except Exception as err:  # noqa: BLE001 - a program may fail on placeholder values
        state._trace.stopped_at = f"{type(err).__name__}: {err}"
    return state._trace
