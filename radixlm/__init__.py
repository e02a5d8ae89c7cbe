"""radixlm: a structured-generation runtime for LLMs, in the line of SGLang."""

from radixlm.runtime.engine import Engine
from radixlm.runtime.server_args import ServerArgs

__all__ = ["Engine", "ServerArgs"]
__version__ = "0.1.0"
