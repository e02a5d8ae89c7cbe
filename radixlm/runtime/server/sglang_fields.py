"""SGLang's request fields that radixlm does not implement, so that SGLang's own clients and
router (``smg``) can talk to it unchanged.

The router re-serialises every body with SGLang's request types, adding their defaults
(``log_metrics``, ``return_hidden_states``, ``background``, ... on ``/generate``;
``continue_final_message``, ``separate_reasoning``, ... on chat), and SGLang clients may
send any field of those types. Each such field radixlm lacks is declared here, typed as
SGLang types it, as one of two kinds:

- ``ignored``: it never changes an answer (logging, metrics labels, routing hints,
  scheduling priority, reasoning display): any value of its type is accepted and dropped;
- ``neutral``: it asks for behaviour radixlm does not have (multimodal inputs, LoRA,
  hidden states, sessions, disaggregation, ...): accepted at its neutral value (its
  default, None, False, 0 or empty) and otherwise a 400 naming it.

A field in neither table, nor radixlm's own, is still an unknown field (400).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, create_model

Kind = Literal["ignored", "neutral"]
FieldSpec = tuple[Kind, Any, Any]
"""(kind, type, default)."""

_ANY_LIST = list[Any] | None
_ANY_DICT = dict[str, Any] | None

# Fields of SGLang's native GenerateReqInput (``POST /generate``).
NATIVE_FIELDS: dict[str, FieldSpec] = {
    "model": ("ignored", str | None, None),
    "log_metrics": ("ignored", bool, True),
    "no_logs": ("ignored", bool, False),
    "custom_labels": ("ignored", dict[str, str] | None, None),
    "priority": ("ignored", int | None, None),
    "routing_key": ("ignored", str | None, None),
    "conversation_id": ("ignored", str | None, None),
    "external_trace_header": ("ignored", _ANY_DICT, None),
    "received_time": ("ignored", float | None, None),
    "session_id": ("neutral", str | None, None),
    "session_params": ("neutral", _ANY_DICT, None),
    "input_embeds": ("neutral", _ANY_LIST, None),
    "image_data": ("neutral", Any, None),
    "video_data": ("neutral", Any, None),
    "audio_data": ("neutral", Any, None),
    "mm_hashes": ("neutral", _ANY_LIST, None),
    "mm_content_hashes": ("neutral", _ANY_LIST, None),
    "use_audio_in_video": ("neutral", bool, False),
    "video_config": ("neutral", _ANY_DICT, None),
    "images_config": ("neutral", _ANY_DICT, None),
    "mm_processor_kwargs": ("neutral", _ANY_DICT, None),
    "modalities": ("neutral", _ANY_LIST, None),
    "max_dynamic_patch": ("neutral", int | None, None),
    "min_dynamic_patch": ("neutral", int | None, None),
    "image_max_dynamic_patch": ("neutral", int | None, None),
    "video_max_dynamic_patch": ("neutral", int | None, None),
    "need_wait_for_mm_inputs": ("neutral", bool | None, None),
    "num_items_assigned": ("neutral", _ANY_DICT, None),
    "encoder_urls": ("neutral", _ANY_LIST, None),
    "watermark": ("neutral", Any, None),
    "token_ids_logprob": ("neutral", _ANY_LIST, None),
    "return_sampling_mask": ("neutral", bool | list[bool] | None, None),
    "sampling_logprobs_mode": ("neutral", Any, None),
    "return_flat_raw_top_logprobs": ("neutral", bool, False),
    "return_flat_raw_output_top_logprobs": ("neutral", bool, False),
    "return_flat_raw_top_logprobs_b64": ("neutral", bool, False),
    "return_hidden_states": ("neutral", bool | str | list[Any], False),
    "return_routed_experts": ("neutral", bool, False),
    "routed_experts_start_len": ("neutral", int, 0),
    "return_indexer_topk": ("neutral", bool, False),
    "return_bytes": ("neutral", bool, False),
    "return_entropy": ("neutral", bool, False),
    "return_prompt_token_ids": ("neutral", bool, False),
    "lora_id": ("neutral", Any, None),
    "custom_logit_processor": ("neutral", Any, None),
    "positional_embed_overrides": ("neutral", Any, None),
    "bootstrap_pair_key": ("neutral", Any, None),
    "decode_tp_size": ("neutral", Any, None),
    "routed_dp_rank": ("neutral", int | None, None),
    "data_parallel_rank": ("neutral", int | None, None),
    "disagg_prefill_dp_rank": ("neutral", int | None, None),
    "http_worker_ipc": ("neutral", str | None, None),
    "background": ("neutral", bool, False),
    "require_reasoning": ("neutral", bool, False),
    "max_thinking_tokens": ("neutral", int | None, None),
    "multi_item_delimiter_indices": ("neutral", _ANY_LIST, None),
    "token_indices_to_pool": ("neutral", _ANY_LIST, None),
    "cache_salt": ("neutral", str | list[str] | None, None),
    "kv_hints": ("neutral", Any, None),
}

# Keys of SGLang's sampling_params dict.
SAMPLING_FIELDS: dict[str, FieldSpec] = {
    "stream_interval": ("ignored", int | None, None),
    "beam_width": ("neutral", int | None, None),
    "custom_params": ("neutral", _ANY_DICT, None),
    "watermark": ("neutral", Any, None),
}

# Fields of SGLang's OpenAI requests, on both routes.
_OPENAI_SHARED: dict[str, FieldSpec] = {
    "priority": ("ignored", int | None, None),
    "custom_labels": ("ignored", dict[str, str] | None, None),
    "return_hidden_states": ("neutral", bool | str, False),
    "return_routed_experts": ("neutral", bool, False),
    "routed_experts_start_len": ("neutral", int, 0),
    "return_cached_tokens_details": ("neutral", bool, False),
    "return_spec_tokens_details": ("neutral", bool, False),
    "return_token_ids": ("neutral", bool, False),
    "lora_path": ("ignored", str | None, None),  # (read by the routes: the adapter)
    "session_id": ("neutral", str | None, None),
    "session_params": ("neutral", _ANY_DICT, None),
    "custom_params": ("neutral", _ANY_DICT, None),
    "custom_logit_processor": ("neutral", Any, None),
    "watermark": ("neutral", Any, None),
    "images_config": ("neutral", _ANY_DICT, None),
    "mm_processor_kwargs": ("neutral", _ANY_DICT, None),
    "data_parallel_rank": ("neutral", int | None, None),
    "cache_salt": ("neutral", str | list[str] | None, None),
}
COMPLETION_FIELDS: dict[str, FieldSpec] = {
    **_OPENAI_SHARED,
    "best_of": ("neutral", int | None, None),
    "suffix": ("neutral", str | None, None),
}
CHAT_FIELDS: dict[str, FieldSpec] = {
    **_OPENAI_SHARED,
    "return_flat_raw_top_logprobs_b64": ("ignored", bool, True),
    "return_prompt_token_ids": ("neutral", bool, False),
    "return_meta_info": ("neutral", bool, False),
    "return_input_ids_in_sglext": ("neutral", bool, False),
    "return_output_ids_in_sglext": ("neutral", bool, False),
    "return_sampling_mask": ("neutral", bool, False),
    "sampling_logprobs_mode": ("neutral", Any, None),
    "return_flat_raw_output_top_logprobs": ("neutral", bool, False),
    "reasoning_effort": ("neutral", Any, None),
    "thinking": ("neutral", Any, None),
    "task": ("neutral", Any, None),
    "continue_final_message": ("neutral", bool, False),
    "max_dynamic_patch": ("neutral", int | None, None),
    "min_dynamic_patch": ("neutral", int | None, None),
    "use_audio_in_video": ("neutral", bool, False),
    "video_config": ("neutral", _ANY_DICT, None),
    "input_ids": ("neutral", list[int] | None, None),
}


def fields_model(name: str, specs: dict[str, FieldSpec], base: type[BaseModel] | None = None,
                 ) -> type[BaseModel]:
    """A pydantic model (or mixin over ``base``) declaring ``specs``' fields."""
    declared = {field: (kind_type, default) for field, (_, kind_type, default) in specs.items()}
    if base is None:
        return create_model(name, __config__=ConfigDict(extra="forbid"), **declared)
    return create_model(name, __base__=base, **declared)


def check_neutral(values: dict[str, Any], specs: dict[str, FieldSpec], where: str = "") -> None:
    """Raises ``ValueError`` naming the first ``neutral`` field of ``values`` (a field
    name -> value map, absent fields allowed) that asks for something radixlm lacks."""
    for field, (kind, _, default) in specs.items():
        if kind != "neutral" or field not in values:
            continue
        value = values[field]
        if value == default or value is None or value is False or value == 0 or (
                isinstance(value, (list, dict, str)) and not value):
            continue
        raise ValueError(f"{where}{field} is an SGLang option radixlm does not support "
                         f"(got {value!r}; leave it out or at {default!r})")


def without_sampling_extras(params: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """``params`` (a sampling_params dict) less SGLang's keys radixlm lacks, each checked
    (``check_neutral``) first; other keys are left for radixlm's own validation."""
    if not isinstance(params, dict):
        return params
    check_neutral(params, SAMPLING_FIELDS, where)
    return {key: value for key, value in params.items() if key not in SAMPLING_FIELDS}
