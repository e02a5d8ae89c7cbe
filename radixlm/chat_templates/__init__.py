"""Chat templates shipped with radixlm, for ``--chat-template NAME`` (SGLang's option): a
template is a ``NAME.jinja`` file here. ``--chat-template`` also takes a Jinja file's path.

- ``chatml-tools``: ChatML with tools in the Hermes form (``<tools>`` in the system turn,
  calls as ``<tool_call>`` JSON, results as ``<tool_response>``), read back by the
  ``qwen25`` tool-call parser: for models whose own template has no tools (the default
  SmolLM2-135M-Instruct's).
"""

from __future__ import annotations

from pathlib import Path

MAX_TEMPLATE_BYTES = 1 << 20
"""The largest template file read (a template is code the server runs on every chat)."""


def shipped_templates() -> list[str]:
    """The names ``--chat-template`` knows."""
    return sorted(path.stem for path in Path(__file__).parent.glob("*.jinja"))


def load_chat_template(name_or_path: str) -> str:
    """The template's text: a shipped template by name, else a file by path. Raises
    ``ValueError`` naming ``--chat-template`` and what is wrong."""
    shipped = Path(__file__).parent / f"{name_or_path}.jinja"
    path = shipped if shipped.is_file() else Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template {name_or_path!r} is neither a file nor a shipped "
                         f"template ({', '.join(shipped_templates())})")
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ValueError(f"--chat-template {path}: the file is over {MAX_TEMPLATE_BYTES} bytes")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template {path}: cannot read it as UTF-8 text: {err}") \
            from None
    try:
        from jinja2 import Environment, TemplateSyntaxError
    except ImportError:  # transformers needs jinja2 for any template; it checks again
        return text
    try:
        Environment().parse(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"--chat-template {path}: not a valid Jinja template: line "
                         f"{err.lineno}: {err.message}") from None
    return text
