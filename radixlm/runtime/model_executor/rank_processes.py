"""Processes of tensor-parallel ranks 1..N-1 (``tp_worker``): started, watched and
stopped by rank 0's model runner on its node (``LocalRanks``), or by ``radixlm serve
--node-rank i`` on another node (``serve_node``), which only hosts that node's ranks."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec

from radixlm.runtime.server_args import ServerArgs

STOP_GRACE_S = 10.0
_RANK_COMMAND = "from radixlm.runtime.model_executor.tp_worker import rank_main; rank_main()"


class RankConfig(msgspec.Struct):
    """What a rank process is started with (msgpack on its stdin)."""

    server_args: ServerArgs
    model_path: str
    rank: int


class LocalRanks:
    """Rank processes this process started: ``ranks`` of ``args.tp_size``."""

    def __init__(self, args: ServerArgs, model_path: str, ranks: range):
        self.processes: dict[int, subprocess.Popen] = {}
        try:
            for rank in ranks:
                process = subprocess.Popen([sys.executable, "-c", _RANK_COMMAND],
                                           stdin=subprocess.PIPE)
                process.stdin.write(msgspec.msgpack.encode(RankConfig(args, model_path, rank)))
                process.stdin.close()
                self.processes[rank] = process
        except BaseException:
            self.stop(0)
            raise

    def failure(self) -> str | None:
        """Why the ranks cannot serve (one of them exited), or None while all run."""
        for rank, process in self.processes.items():
            if process.poll() is not None:
                return (f"tensor-parallel rank {rank} exited (exit code "
                        f"{process.returncode})")
        return None

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Waits up to ``grace`` seconds for the ranks to exit (after rank 0 told them),
        then kills the rest."""
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def serve_node(args: ServerArgs, model_path: str) -> int:
    """``radixlm serve --node-rank i`` for i > 0: this node's share of the ranks, until
    they exit (rank 0 stops them, or they fail); returns the worst exit code."""
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    ranks = LocalRanks(args, model_path, range(first, first + per_node))
    try:
        for process in ranks.processes.values():
            process.wait()
    finally:
        ranks.stop(0)
    return max(abs(p.returncode or 0) for p in ranks.processes.values())
