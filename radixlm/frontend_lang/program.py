"""``@function``: a Python function that writes to ``s``, with ``run``, ``run_batch``,
``bind`` and ``trace``."""

from __future__ import annotations

import concurrent.futures
import inspect
import threading
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import tqdm

from radixlm.frontend_lang.backends import resolve_backend
from radixlm.frontend_lang.backends.base import Backend
from radixlm.frontend_lang.chat_template import BUILTIN_TEMPLATES
from radixlm.frontend_lang.executor import Executor
from radixlm.frontend_lang.ir import GenParams
from radixlm.frontend_lang.program_state import ProgramState
from radixlm.frontend_lang.tracer import ProgramTrace, trace_program

SAMPLING_OPTIONS = frozenset(f.name for f in fields(GenParams)) - {
    "n", "dtype", "regex", "json_schema"}
"""Keyword arguments of ``run`` / ``run_batch`` that set the defaults of every ``gen``."""

DEFAULT_MAX_NEW_TOKENS = 128
MAX_AUTO_THREADS = 128


class Program:
    """A program: ``func(s, *args)`` appends to ``s``. Calling it runs it."""

    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None,
                 num_api_spec_tokens: int | None = None) -> None:
        if not callable(func):
            raise TypeError(f"@function needs a function, got {type(func).__name__}")
        self.func = func
        self.bound = dict(bound or {})
        self.num_api_spec_tokens = num_api_spec_tokens
        self._signature = inspect.signature(func)
        if not self._signature.parameters:
            raise TypeError(f"program {func.__name__} must take the state `s` as its first "
                            "argument")
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        """A copy of the program with some arguments fixed."""
        return Program(self.func, {**self.bound, **kwargs}, self.num_api_spec_tokens)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(self, *args: Any, stream: bool = False, backend: Any = None,
            use_thread: bool = True, **kwargs: Any) -> ProgramState:
        """Runs the program once. Keyword arguments named like ``gen`` options (``max_new_
        tokens``, ``temperature``, ...) set the defaults of every ``gen``; the others go to
        the program. Without ``stream`` returns when everything ran (raising
        :class:`ProgramError` if a call failed); with it, at once: read the text with
        ``text_iter``. ``use_thread`` is accepted for SGLang compatibility (a state always
        runs its expressions on a worker thread)."""
        options, program_kwargs = _split_options(kwargs)
        arguments = self._arguments(args, program_kwargs)
        executor = Executor(resolve_backend(backend), _defaults(options), stream)
        state = ProgramState(executor)
        if not stream:
            self._execute(state, arguments)
            state.sync()
            return state
        executor.program_thread = None  # nobody may read as the program's own thread yet
        thread = threading.Thread(target=self._execute_quietly, args=(state, arguments),
                                  daemon=True, name=f"radixlm-{self.__name__}")
        thread.start()
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  **options: Any) -> list[ProgramState]:
        """Runs the program once per dict of arguments, concurrently; states come back in
        order. An item whose program fails keeps its state, with ``error()`` set, and the
        others are unaffected. With more than one item, the program's constant prefix is
        cached first."""
        if not isinstance(batch_kwargs, list) or not all(
                isinstance(item, dict) for item in batch_kwargs):
            raise TypeError("batch_kwargs must be a list of dicts of program arguments")
        unknown = sorted(set(options) - SAMPLING_OPTIONS)
        if unknown:
            raise TypeError(f"run_batch got unknown options {unknown}; program arguments go "
                            "in batch_kwargs")
        threads = _thread_count(num_threads, len(batch_kwargs))
        arguments = []
        for index, item in enumerate(batch_kwargs):
            try:
                arguments.append(self._arguments((), item))
            except TypeError as err:
                raise TypeError(f"batch_kwargs[{index}]: {err}") from None
        resolved = resolve_backend(backend)
        defaults = _defaults(options)
        if len(batch_kwargs) > 1:
            resolved.cache_prefix(trace_program(self.func, self.bound,
                                                resolved.chat_template).prefix)
        states = [ProgramState(Executor(resolved, defaults)) for _ in batch_kwargs]
        with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool, tqdm.tqdm(
                total=len(states), disable=not progress_bar, desc=self.__name__) as bar:
            futures = [pool.submit(self._execute_quietly, state, args)
                       for state, args in zip(states, arguments)]
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.update(1)
        return states

    def trace(self, *, backend: Any = None, **kwargs: Any) -> ProgramTrace:
        """The program's constant prefix (with ``kwargs`` as known arguments)."""
        try:
            template = resolve_backend(backend).chat_template
        except ValueError:
            template = BUILTIN_TEMPLATES["chatml"]
        return trace_program(self.func, {**self.bound, **kwargs}, template)

    def _arguments(self, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> inspect.BoundArguments:
        """The program's arguments (the state left as None); a TypeError names a missing
        or unknown one."""
        try:
            return self._signature.bind(None, *args, **{**self.bound, **kwargs})
        except TypeError as err:
            raise TypeError(f"{self.__name__}: {err}") from None

    def _execute(self, state: ProgramState, arguments: inspect.BoundArguments) -> None:
        executor = state._executor
        executor.program_thread = threading.get_ident()
        try:
            state.ret_value = self._call(state, arguments)
        except BaseException as err:
            executor.fail(err)
            raise
        finally:
            executor.finish()

    def _execute_quietly(self, state: ProgramState, arguments: inspect.BoundArguments) -> None:
        try:
            self._execute(state, arguments)
            state._executor.sync()
        except Exception:  # noqa: BLE001 - kept on the state; see ProgramState.error()
            return

    def _call(self, state: ProgramState, arguments: inspect.BoundArguments) -> Any:
        arguments.arguments[next(iter(self._signature.parameters))] = state
        return self.func(*arguments.args, **arguments.kwargs)


def function(func: Callable[..., Any] | None = None,
             num_api_spec_tokens: int | None = None) -> Any:
    """Decorates a program: ``@function`` or ``@function(num_api_spec_tokens=...)``."""
    if func is None:
        return lambda f: Program(f, num_api_spec_tokens=num_api_spec_tokens)
    return Program(func, num_api_spec_tokens=num_api_spec_tokens)


def _split_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    options = {k: v for k, v in kwargs.items() if k in SAMPLING_OPTIONS}
    return options, {k: v for k, v in kwargs.items() if k not in SAMPLING_OPTIONS}


def _defaults(options: dict[str, Any]) -> GenParams:
    return GenParams(**{"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **options})


def _thread_count(num_threads: int | str, items: int) -> int:
    if num_threads == "auto":
        return min(items, MAX_AUTO_THREADS)
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive integer, got "
                         f"{num_threads!r}")
    return num_threads


__all__ = ["Backend", "Program", "function"]
