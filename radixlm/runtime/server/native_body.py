"""The body of ``POST /generate``: ``GenerateInput``'s fields, and the rest of SGLang's
``GenerateReqInput`` (``sglang_fields.NATIVE_FIELDS``), which SGLang's router and clients
send and radixlm accepts at their neutral values. Unknown fields are still refused."""

from __future__ import annotations

import dataclasses
import typing

from pydantic import ConfigDict, create_model

from radixlm.runtime.engine.request_inputs import GenerateInput
from radixlm.runtime.server.sglang_fields import (
    NATIVE_FIELDS,
    check_neutral,
    without_sampling_extras,
)

_HINTS = typing.get_type_hints(GenerateInput)
_OWN = {f.name: (_HINTS[f.name], f.default) for f in dataclasses.fields(GenerateInput)}

GenerateBody = create_model(
    "GenerateBody", __config__=ConfigDict(extra="forbid"), **_OWN,
    **{name: (kind_type, default) for name, (_, kind_type, default) in NATIVE_FIELDS.items()},
)
"""SGLang's native generate request, as radixlm validates it."""


def generate_input(body: GenerateBody) -> GenerateInput:
    """The request ``body`` makes; raises ``ValueError`` naming an SGLang field (or
    sampling parameter) set to something radixlm does not do."""
    values = {name: getattr(body, name) for name in body.model_fields_set}
    check_neutral(values, NATIVE_FIELDS)
    own = {name: getattr(body, name) for name in _OWN}
    params = own["sampling_params"]
    if isinstance(params, list):
        own["sampling_params"] = [without_sampling_extras(p, f"sampling_params[{i}].")
                                  for i, p in enumerate(params)]
    else:
        own["sampling_params"] = without_sampling_extras(params, "sampling_params.")
    return GenerateInput(**own)
