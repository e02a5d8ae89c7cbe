"""Which model a request names: the served model (by its served name or path), or one of
its LoRA adapters (``model:adapter``, or the adapter's name, as vLLM lists adapters). The
served model's own names always mean the base model, even where an adapter shares one."""

from __future__ import annotations

from radixlm.runtime.engine.engine import Engine


def resolve_model(engine: Engine, name: str, served_model_name: str) -> tuple[bool, str | None]:
    """(whether ``name`` names the served model or one of its adapters, the adapter or
    None for the base model)."""
    bases = (served_model_name, str(engine.model_config.path))
    if name in bases:
        return True, None
    adapters = engine.lora_adapters()
    base, sep, adapter = name.rpartition(":")
    if sep and base in bases and adapter in adapters:
        return True, adapter
    if name in adapters:
        return True, name
    return False, None


def unknown_model_message(engine: Engine, name: str, served_model_name: str) -> str:
    adapters = engine.lora_adapters()
    return (f"The model `{name}` does not exist; this server serves `{served_model_name}`"
            + (f" and the adapters {adapters}" if adapters else ""))
