"""The process that renders chat templates sent with requests (``--trust-request-chat-template``).

Started by ``ClientTemplateRenderer`` as
``python -m radixlm.runtime.engine.template_render_worker TOKENIZER_PATH HEADROOM_BYTES``.
Once the tokenizer is loaded it says ``{"ready": true}``, caps its own data memory at what it
uses then plus ``HEADROOM_BYTES`` (``RLIMIT_DATA``), and answers one JSON request per stdin
line with one JSON reply per stdout line:

    {"messages": [...], "kwargs": {...}, "max_chars": N}  ->  {"text": "..."} | {"error": "..."}

A template that prints without end fails on the memory cap, not the server's memory; one that
loops without end is killed by the server past its time limit. It ends when stdin closes. Only
JSON crosses the pipes, both ways (nothing is unpickled).
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any, BinaryIO

import msgspec
from jinja2 import TemplateError

TEMPLATE_FAILURES = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                     RecursionError, OverflowError)
"""What a template given values of types it cannot take (or written to fail) raises."""


def data_bytes_in_use() -> int:
    """This process's data segment and private mappings (``VmData``), the measure
    ``RLIMIT_DATA`` caps."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmData line")


def render(tokenizer: Any, request: dict[str, Any]) -> dict[str, str]:
    """The reply to one request: the rendered prompt, or why there is none."""
    try:
        text = tokenizer.apply_chat_template(
            request["messages"], tokenize=False, add_generation_prompt=True, **request["kwargs"])
    except TEMPLATE_FAILURES as err:
        return {"error": f"{type(err).__name__}: {err}"}
    if not isinstance(text, str):
        return {"error": "the template did not render to text"}
    if len(text) > request["max_chars"]:
        return {"error": f"it made a prompt of {len(text)} characters (at most "
                         f"{request['max_chars']} fit the context)"}
    return {"text": text}


def serve(tokenizer: Any, requests: BinaryIO, replies: BinaryIO) -> None:
    """Answers requests until ``requests`` ends. A reply that cannot be built within the
    memory cap ends the process (the server sees the pipe close and starts a new one)."""
    for line in requests:
        try:
            reply = render(tokenizer, msgspec.json.decode(line))
        except MemoryError:
            os._exit(3)  # the heap may be in any state: leave at once
        except (msgspec.DecodeError, KeyError, TypeError) as err:
            reply = {"error": f"a malformed render request ({err})"}
        replies.write(msgspec.json.encode(reply) + b"\n")
        replies.flush()


def main(tokenizer_path: str, headroom_bytes: int) -> None:
    from transformers import AutoTokenizer

    replies, sys.stdout = sys.stdout.buffer, sys.stderr  # stray prints stay off the pipe
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    cap = data_bytes_in_use() + headroom_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    replies.write(msgspec.json.encode({"ready": True}) + b"\n")
    replies.flush()
    serve(tokenizer, sys.stdin.buffer, replies)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
