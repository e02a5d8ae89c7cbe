"""radixlm: a structured-generation runtime for LLMs, in the line of SGLang.

``import radixlm`` loads only the frontend DSL (``function``, ``gen``, ``select``,
``RuntimeEndpoint``...), enough for a script that talks to a server; ``Engine`` and
``ServerArgs`` load on first use (PEP 562), with torch and transformers behind them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixlm.openmp_policy import apply_openmp_policy

apply_openmp_policy()  # before anything loads torch, in this process and its children

from radixlm.frontend_lang import *  # noqa: E402, F403 - the DSL's public names
from radixlm.frontend_lang import __all__ as _frontend_names  # noqa: E402

if TYPE_CHECKING:
    from radixlm.runtime.engine.engine import Engine
    from radixlm.runtime.server_args import ServerArgs

_LAZY_NAMES = {
    "Engine": "radixlm.runtime.engine.engine",
    "ServerArgs": "radixlm.runtime.server_args",
}
"""Public names loaded on first access: name -> the module defining it."""

__all__ = ["Engine", "ServerArgs", *_frontend_names]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})
