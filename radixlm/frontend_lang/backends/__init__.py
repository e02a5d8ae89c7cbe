"""Where programs send their requests, and the process-wide default backend."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from radixlm.frontend_lang.backends.base import Backend, BackendError, Prompt

_default: Backend | None = None
_engine_backends: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def as_backend(backend: Any) -> Backend:
    """A :class:`Backend` for ``backend``: a backend itself, or a :class:`radixlm.Engine`
    (wrapped once per engine)."""
    from radixlm.frontend_lang.backends.native import EngineBackend
    from radixlm.runtime.engine.engine import Engine

    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, Engine):
        with _lock:
            if backend not in _engine_backends:
                _engine_backends[backend] = EngineBackend(backend)
            return _engine_backends[backend]
    raise TypeError(f"a backend must be a RuntimeEndpoint, an OpenAI backend or a "
                    f"radixlm.Engine, got {type(backend).__name__}")


def set_default_backend(backend: Any) -> None:
    """Programs run here unless ``run(backend=...)`` says otherwise (``None`` clears it)."""
    global _default
    _default = None if backend is None else as_backend(backend)


def resolve_backend(backend: Any = None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default is None:
        raise ValueError("no backend: pass backend=... or call "
                         "radixlm.set_default_backend(RuntimeEndpoint(url) or an Engine)")
    return _default


__all__ = ["Backend", "BackendError", "Prompt", "as_backend", "resolve_backend",
           "set_default_backend"]
