"""Starting and stopping the Scheduler and Detokenizer processes.

Each is a fresh interpreter calling ``child_main`` here (``python -c``), so nothing of the
caller's main script is re-imported (scripts need no ``if __name__ == "__main__"`` guard, and
notebooks work), and nothing is pickled: a child gets its options as msgpack on stdin and
reports readiness, as msgpack, through a pipe of its own. The processes talk over
``ipc://`` sockets in a private temporary directory (mode 0700).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from radixlm.runtime import messages as wire
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 5.0
ROLES = ("scheduler", "detokenizer")


@dataclass
class RuntimeProcesses:
    paths: wire.SocketPaths
    processes: dict[str, subprocess.Popen]
    socket_dir: str
    scheduler_info: dict[str, Any]
    """What the scheduler reported when ready (pool size, context length, ...)."""

    def stop(self, graceful: bool = True) -> None:
        """Waits for the processes to exit (when they were asked to), then ends any that
        linger; without ``graceful``, terminates them at once."""
        if not graceful:
            for process in self.processes.values():
                process.terminate()
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for process in self.processes.values():
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(2.0)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def start_runtime_processes(
    args: ServerArgs, model_path: str, tokenizer_path: str, decoder_json: str | None = None
) -> RuntimeProcesses:
    """Starts both processes and waits until they are ready; a failure to start raises
    ``ValueError`` (bad model or options) or ``RuntimeError``, leaving nothing running.
    ``decoder_json``: the tokenizer's Rust backend the Detokenizer decodes with
    (``text_decoder.backend_decoder_json``), written into the private directory."""
    if (warning := args.dtype_warning()) is not None:
        logger.warning(warning)
    socket_dir = tempfile.mkdtemp(prefix="radixlm-")
    os.chmod(socket_dir, 0o700)
    paths = wire.SocketPaths(*(f"ipc://{socket_dir}/{name}" for name in
                             ("scheduler", "detokenizer", "request_tracker")))
    decoder_path = None
    if decoder_json is not None:
        decoder_path = os.path.join(socket_dir, "decoder.json")
        with open(decoder_path, "w", encoding="utf-8") as out:
            out.write(decoder_json)
    config = msgspec.msgpack.encode(
        wire.ChildConfig(args, model_path, tokenizer_path, paths, decoder_path))
    runtime = RuntimeProcesses(paths, {}, socket_dir, {})
    ready_fds = {}
    try:
        for role in ROLES:
            read_fd, write_fd = os.pipe()
            runtime.processes[role] = subprocess.Popen(
                [sys.executable, "-c", _CHILD_COMMAND, role, str(write_fd)],
                stdin=subprocess.PIPE, pass_fds=(write_fd,),
            )
            os.close(write_fd)
            ready_fds[role] = read_fd
            runtime.processes[role].stdin.write(config)
            runtime.processes[role].stdin.close()
        for role in ROLES:
            reply = _wait_ready(role, ready_fds[role], runtime.processes[role])
            if role == "scheduler":
                runtime.scheduler_info = reply.info
    except BaseException:
        for process in runtime.processes.values():
            process.kill()
        runtime.stop()
        raise
    finally:
        for fd in ready_fds.values():
            os.close(fd)
    return runtime


def _wait_ready(role: str, fd: int, process: subprocess.Popen) -> wire.ControlReply:
    """Reads the child's ready message (the pipe closes after it)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    data = b""
    while True:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {role} process did not start in {STARTUP_TIMEOUT_S:.0f} s")
        readable, _, _ = select.select([fd], [], [], 0.1)
        if readable:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
        elif process.poll() is not None:
            break
    if not data:
        raise RuntimeError(f"the {role} process exited while starting "
                           f"(exit code {process.poll()})")
    reply = wire.decode(data)
    if isinstance(reply, wire.ProcessFailed):
        raise ValueError(reply.message)
    return reply


class _ReadyPipe:
    """The child's end: one message, then closed."""

    def __init__(self, fd: int):
        self.fd = fd

    def send_bytes(self, data: bytes) -> None:
        with os.fdopen(self.fd, "wb") as pipe:
            pipe.write(data)


_CHILD_COMMAND = f"import sys; from {__name__} import child_main; child_main(*sys.argv[1:])"
"""A child's program: importing the module by name (not ``-m``) loads it exactly once."""


ONEDNN_PRIMITIVE_CACHE = 256


def child_main(role: str, ready_fd: str) -> None:
    """A child process's entry point (importing ``radixlm`` on the way here applied
    ``radixlm.openmp_policy`` before torch loads).

    Once its loop has ended and it has closed its sockets and stopped what it started (TP
    ranks, transfer engines), a child leaves with ``os._exit``: the interpreter's
    finalization would free torch, the model and the tokenizer object by object while the
    caller's ``shutdown`` waits, and gives back nothing that the kernel does not reclaim at
    exit (figures: benchmarks/RESULTS.md). A child that fails with an exception exits as
    Python does, with its traceback."""
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=wire.ChildConfig)
    args, paths = config.server_args, config.paths
    ready = _ReadyPipe(int(ready_fd))
    try:
        if role == "scheduler":
            # oneDNN keeps a compiled primitive per matmul shape, up to 1,024 by default: with
            # prompts of every length that is ~200 MiB of RSS that looks like a leak. A quarter
            # of that holds every decode batch size and the recent prefill lengths.
            os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))
            from radixlm.runtime.scheduler.scheduler_process import run_scheduler_process

            run_scheduler_process(args, config.model_path, paths, ready)
        else:
            from radixlm.runtime.detokenizer.detokenizer_process import run_detokenizer_process

            run_detokenizer_process(config.tokenizer_path, paths, ready, config.decoder_path)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)
