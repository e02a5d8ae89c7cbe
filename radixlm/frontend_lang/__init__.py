"""The ``@function`` DSL: multi-call programs written in Python, run against a backend.

``import radixlm as sgl`` gives SGLang's frontend names; see docs/frontend.md.
"""

from radixlm.frontend_lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixlm.frontend_lang.backends import set_default_backend
from radixlm.frontend_lang.backends.base import BackendError
from radixlm.frontend_lang.backends.openai_backend import OpenAI
from radixlm.frontend_lang.backends.runtime_endpoint import RuntimeEndpoint
from radixlm.frontend_lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.frontend_lang.executor import ProgramError
from radixlm.frontend_lang.program import Program, function
from radixlm.frontend_lang.program_state import ProgramState, ProgramStateGroup

__all__ = [
    "BackendError", "OpenAI", "Program", "ProgramError", "ProgramState", "ProgramStateGroup",
    "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end", "flush_cache",
    "function", "gen", "gen_int", "gen_string", "get_server_info", "greedy_token_selection",
    "image", "select", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end",
]
