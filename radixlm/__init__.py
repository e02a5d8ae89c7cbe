"""radixlm: a structured-generation runtime for LLMs, in the line of SGLang."""

import os

# Torch's OpenMP threads spin while they wait by default, which starves the other thread on
# a small, shared CPU; this must be set before torch loads to take effect.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from radixlm.frontend_lang import *  # noqa: E402, F403 - the DSL's public names
from radixlm.frontend_lang import __all__ as _frontend_names  # noqa: E402
from radixlm.runtime.engine.engine import Engine  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

__all__ = ["Engine", "ServerArgs", *_frontend_names]
__version__ = "0.1.0"
