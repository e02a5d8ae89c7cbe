"""radixlm: a structured-generation runtime for LLMs, in the line of SGLang."""

import os

# Torch's OpenMP threads spin while they wait by default, which starves the other thread on
# a small, shared CPU; this must be set before torch loads to take effect.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from radixlm.runtime.engine import Engine  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

__all__ = ["Engine", "ServerArgs"]
__version__ = "0.1.0"
