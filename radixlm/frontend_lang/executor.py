"""The interpreter: one executor per program state runs its expressions in order.

The program's Python code only submits expressions (``s += ...`` returns at once); a worker
thread runs them against the backend. Reading a variable waits until it is set, so code reads
naturally while forks and ``run_batch`` items reach the backend concurrently, where the runtime
batches them.

Invariants: expressions of one state run one at a time, in submission order; a worker thread
exists only while expressions are pending; after an expression fails, the rest are skipped
and every wait ends by raising :class:`ProgramError` with the failure as its cause.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from radixlm.frontend_lang import ir
from radixlm.frontend_lang.backends.base import Backend, Prompt


class ProgramError(RuntimeError):
    """A program could not finish; ``__cause__`` is what went wrong."""


class Executor:
    """Runs one state's expressions; holds its text, messages, variables and meta info."""

    def __init__(self, backend: Backend, defaults: ir.GenParams, stream: bool = False) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.finished = False  # set once the program will submit nothing more
        self.program_thread = threading.get_ident()  # the thread that runs the program code
        self._open_role: str | None = None
        self._role_start = 0
        self._roles_seen = 0
        self._scope_starts: dict[str, int] = {}
        self._stream_starts: dict[str, int] = {}  # variables being generated: text offset
        self._assigned: set[str] = set()  # variables set since this executor was created
        self._fork_start = 0
        self._pending: deque[ir.Expr] = deque()
        self._running = False
        self._cond = threading.Condition()

    # -- submitting and waiting -------------------------------------------------------
    def submit(self, expr: Any) -> None:
        leaves = ir.flatten(ir.as_expr(expr))
        with self._cond:
            self._pending.extend(leaves)
            if not self._running and self._pending:
                self._running = True
                threading.Thread(target=self._drain, daemon=True,
                                 name="radixlm-program").start()

    def sync(self) -> None:
        """Waits until every submitted expression has run; raises if one failed."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending)
            self._raise_if_failed()

    def finish(self) -> None:
        with self._cond:
            self.finished = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Records a failure from outside the worker (the program function raised), and
        waits until the expression running now has ended: the ones still queued are
        skipped, so nothing of the program runs on once its failure is reported."""
        with self._cond:
            self.error = self.error or error
            self.finished = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._running)

    def get_var(self, name: str) -> Any:
        with self._cond:
            # The program's own thread can submit nothing while it waits here; any other
            # reader waits until the program has finished submitting.
            own_thread = threading.get_ident() == self.program_thread
            self._cond.wait_for(lambda: name in self.variables or self.error is not None or (
                not self._pending and (self.finished or own_thread)))
            if name in self.variables:
                return self.variables[name]
            self._raise_if_failed()
            raise KeyError(f"unknown variable {name!r}; this state has "
                           f"{sorted(self.variables) or 'no variables'}")

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        with self._cond:
            self._store(name, value, None)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise ProgramError(f"the program failed: {self.error}") from self.error

    # -- streaming ------------------------------------------------------------------------
    def wait_text(self, var_name: str | None, seen: int) -> tuple[str, bool]:
        """Text beyond ``seen`` characters (of the whole text, or of ``var_name``) once there
        is some, and whether that is all there will be."""
        def ready() -> bool:
            return self.error is not None or self._text_done(var_name) or \
                len(self._current(var_name)) > seen
        with self._cond:
            self._cond.wait_for(ready)
            self._raise_if_failed()
            return self._current(var_name)[seen:], self._text_done(var_name)

    def _current(self, var_name: str | None) -> str:
        if var_name is None:
            return self.text
        if var_name in self._stream_starts:
            return self.text[self._stream_starts[var_name]:]
        value = self.variables.get(var_name, "")
        return value if isinstance(value, str) else str(value)

    def _text_done(self, var_name: str | None) -> bool:
        idle = self.finished and not self._pending
        if var_name is None:
            return idle
        return (var_name in self.variables and var_name not in self._stream_starts) or idle

    # -- forks ------------------------------------------------------------------------------
    def fork(self, size: int) -> list[Executor]:
        self.sync()
        if size > 1 and self.text:
            self.backend.cache_prefix(self.text)
        children = []
        for _ in range(size):
            child = Executor(self.backend, self.defaults, self.stream)
            child.text, child.messages = self.text, list(self.messages)
            child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
            child._open_role, child._role_start = self._open_role, self._role_start
            child._roles_seen, child._fork_start = self._roles_seen, len(self.text)
            child.program_thread = threading.get_ident()
            children.append(child)
        return children

    def join(self, children: list[Executor], mode: str) -> None:
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', "
                             f"got {mode!r}")
        for index, child in enumerate(children):
            try:
                child.sync()
            except ProgramError:
                raise ProgramError(f"fork branch {index} failed: {child.error}") \
                    from child.error
            child.finish()
        self.sync()
        with self._cond:
            if mode == "concate_and_append":
                self._append("".join(child.text[child._fork_start:] for child in children))
                return
            names = sorted(set().union(*(child._assigned for child in children)))
            for name in names:
                self._store(name, [child.variables.get(name) for child in children],
                            [child.meta_info.get(name) for child in children])

    # -- the worker -------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._running = False
                    self._cond.notify_all()
                    return
                expr, failed = self._pending[0], self.error is not None
            try:
                if not failed:
                    self._execute(expr)
            except BaseException as err:  # noqa: BLE001 - reported to whoever waits
                with self._cond:
                    self.error = err
            with self._cond:
                self._pending.popleft()
                self._cond.notify_all()

    def _execute(self, expr: ir.Expr) -> None:
        if isinstance(expr, ir.Constant):
            with self._cond:
                self._append(expr.text)
        elif isinstance(expr, ir.Gen):
            self._gen(expr)
        elif isinstance(expr, ir.Select):
            self._select(expr)
        elif isinstance(expr, (ir.RoleBegin, ir.RoleEnd)):
            self._role(expr)
        elif isinstance(expr, ir.VarScopeBegin):
            self._scope_starts[expr.name] = len(self.text)
        elif isinstance(expr, ir.VarScopeEnd):
            if expr.name not in self._scope_starts:
                raise ValueError(f"var_scope {expr.name!r} ends without a beginning")
            with self._cond:
                self._store(expr.name, self.text[self._scope_starts.pop(expr.name):], None)
        elif isinstance(expr, ir.Image):
            raise ValueError(f"image({expr.path!r}): this runtime serves text-only models")
        else:
            raise TypeError(f"cannot run {type(expr).__name__} in a program")

    def _prompt(self) -> Prompt:
        content = self.text[self._role_start:] if self._open_role else ""
        return Prompt(self.text, list(self.messages), self._open_role, content)

    def _gen(self, expr: ir.Gen) -> None:
        params = expr.params.merged_over(self.defaults)
        if params.n not in (None, 1):
            raise ValueError("gen(n=...) above 1 is not supported; use s.fork(n)")
        if not self.stream:
            text, meta = self.backend.generate(self._prompt(), params)
            with self._cond:
                self._append(text)
                if expr.name:
                    self._store(expr.name, text, meta)
            return
        name = expr.name or f"_gen_{len(self.text)}"
        with self._cond:
            start = len(self.text)
            self._stream_starts[name] = start
        meta: dict[str, Any] = {}
        try:
            for piece, latest in self.backend.generate_stream(self._prompt(), params):
                with self._cond:
                    self._append(piece)
                    meta = latest
                    if expr.name:
                        self.meta_info[expr.name] = meta  # for text_async_iter's readers
        except BaseException:
            with self._cond:
                del self._stream_starts[name]
            raise
        with self._cond:  # one step, so a reader never sees the variable in between
            del self._stream_starts[name]
            if expr.name:
                self._store(expr.name, self.text[start:], meta)

    def _select(self, expr: ir.Select) -> None:
        decision = self.backend.select(self._prompt(), list(expr.choices), expr.choices_method,
                                       expr.temperature)
        with self._cond:
            self._append(decision.decision)
            if expr.name:
                self._store(expr.name, decision.decision, decision.meta_info)

    def _role(self, expr: ir.RoleBegin | ir.RoleEnd) -> None:
        template = self.backend.chat_template
        with self._cond:
            if isinstance(expr, ir.RoleBegin):
                if self._open_role is not None:
                    raise ValueError(f"role {expr.role!r} begins inside the open "
                                     f"{self._open_role!r} role; roles do not nest")
                self._append(template.begin(expr.role, first=self._roles_seen == 0))
                self._open_role, self._role_start = expr.role, len(self.text)
                self._roles_seen += 1
                return
            if self._open_role != expr.role:
                raise ValueError(f"role {expr.role!r} ends, but the open role is "
                                 f"{self._open_role!r}")
            self.messages.append({"role": expr.role,
                                  "content": self.text[self._role_start:]})
            self._append(template.end(expr.role))
            self._open_role = None

    def _append(self, text: str) -> None:
        """Appends to the state's text (caller holds the lock)."""
        self.text += text
        self._cond.notify_all()

    def _store(self, name: str, value: Any, meta: Any) -> None:
        """Sets a variable and its meta info (caller holds the lock)."""
        self.variables[name] = value
        self.meta_info[name] = meta
        self._assigned.add(name)
        self._cond.notify_all()
