"""What a tool-call parser reads and returns: the functions a request offers, the calls a
model wrote, and the interface every format's parser implements (``formats/``).

Invariants every parser keeps (tests/runtime/output_parsing check them on a corpus and with
property tests):

- ``parse(text)`` never raises on model output: text that looks like a call but does not
  parse (a bad marker, JSON that does not load, arguments that are not an object) is
  returned as content, byte for byte.
- Streaming equals parsing: for any split of ``text`` into pieces fed to ``stream()`` in
  order, then ``finish()``, the content pieces joined equal ``parse(text).content`` and the
  calls equal ``parse(text).calls``, in order.
- A call's ``arguments`` is the text of a JSON object. Formats whose arguments are JSON keep
  the model's own text of it (so a stream's pieces and the final call agree); formats that
  write arguments otherwise (XML parameters, Python keywords) give ``json.dumps`` of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class FunctionTool:
    """One function a request offers (OpenAI's ``tools[i].function``)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})
    description: str | None = None
    strict: bool = False

    def openai_tool(self) -> dict[str, Any]:
        """The function as an OpenAI ``tools`` item: what chat templates take (transformers'
        ``apply_chat_template(tools=...)``) and xgrammar's builtin structural tags read.
        ``strict`` is left out: xgrammar drops the schema of a tool whose ``strict`` is
        false, and a structural tag's arguments always follow the schema."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the function's name and its arguments (a JSON object's
    text)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedToolCalls:
    """A whole output split into the text meant for the user and the calls, in order."""

    content: str
    calls: list[ToolCall]


StreamPiece = str | ToolCall
"""What a stream gives back: content text (str) or a complete call."""


class ToolCallStream(ABC):
    """Incremental parsing of one output. Content that may still turn out to be the start of
    a call is held back until it is decided; a call is given when it is complete (its closing
    marker, or the end of the output for formats that have none)."""

    @abstractmethod
    def feed(self, text: str) -> list[StreamPiece]:
        """Takes the next piece of the output; returns what is now decided."""

    @abstractmethod
    def finish(self) -> list[StreamPiece]:
        """The output has ended: returns everything still held (undecided text as content)."""


class ToolCallParser(ABC):
    """One model family's format of tool calls (``--tool-call-parser NAME``)."""

    name: ClassVar[str]
    """The parser's name, as SGLang names it."""

    @abstractmethod
    def parse(self, text: str) -> ParsedToolCalls:
        """The content and calls of a whole output; never raises (see module docstring)."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser of one output."""

    @abstractmethod
    def structural_tag(self, tools: list[FunctionTool], at_least_one: bool,
                       parallel: bool) -> dict[str, Any]:
        """An xgrammar structural tag (its JSON form, ``{"type": "structural_tag", "format":
        ...}``) that lets the model write text and calls of ``tools`` in this format, each
        call's arguments valid against its function's ``parameters``; with ``at_least_one``
        the output is one or more calls and nothing else (``tool_choice`` ``required`` or a
        named function, whose list then has that function only); ``parallel`` false allows
        one call at most."""
