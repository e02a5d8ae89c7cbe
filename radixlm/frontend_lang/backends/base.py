"""What a backend does for the interpreter: generate, score choices, cache a prefix.

Backends are thread-safe: the interpreter calls one backend from many executor threads at
once (forks, ``run_batch``), which is how those requests reach the runtime as one batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from radixlm.frontend_lang.chat_template import ChatTemplate
from radixlm.frontend_lang.choices import ChoicesDecision, ChoicesMethod
from radixlm.frontend_lang.ir import GenParams


class BackendError(RuntimeError):
    """The backend could not serve a call: unreachable, refused the request, or cannot do it."""


@dataclass
class Prompt:
    """What a program has written so far, as text and as chat messages.

    ``messages`` holds the finished role turns; ``open_role`` is the turn being written (its
    content so far in ``open_content``), ``None`` outside any role.
    """

    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: str | None = None
    open_content: str = ""


class Backend(ABC):
    """A model behind some API. ``chat_template`` renders the program's roles."""

    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate: ...

    @abstractmethod
    def generate(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        """The generated text and its ``meta_info``."""

    @abstractmethod
    def generate_stream(self, prompt: Prompt,
                        params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Pieces of generated text as they come (each new, not cumulative) and the
        ``meta_info`` known so far; the last piece carries the final ``meta_info``."""

    @abstractmethod
    def select(self, prompt: Prompt, choices: list[str], method: ChoicesMethod,
               temperature: float) -> ChoicesDecision: ...

    def cache_prefix(self, text: str) -> None:  # noqa: B027 - optional for a backend
        """Make ``text`` a cached prefix before requests that share it run (a hint)."""

    def flush_cache(self) -> None:
        raise BackendError(f"{type(self).__name__} has no cache to flush")

    def get_server_info(self) -> dict[str, Any]:
        raise BackendError(f"{type(self).__name__} does not report server info")

    def shutdown(self) -> None:  # noqa: B027 - most backends hold nothing
        """Release what the backend holds."""
