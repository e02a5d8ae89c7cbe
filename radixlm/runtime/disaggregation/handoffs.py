"""Builds a scheduler's side of prefill/decode disaggregation from the server's options:
on a prefill server, the transfer link, the bootstrap service (registered in it the way
SGLang's prefill ranks register) and the ``PrefillHandoff``; on a decode server, the
link and the ``DecodeHandoff``."""

from __future__ import annotations

import logging
import secrets

import torch

from radixlm.runtime.disaggregation.bootstrap import BootstrapServer, register
from radixlm.runtime.disaggregation.decode_handoff import DecodeHandoff
from radixlm.runtime.disaggregation.kv_rows import KVLayout
from radixlm.runtime.disaggregation.mooncake_backend import (
    MooncakeDecodeLink,
    MooncakePrefillLink,
)
from radixlm.runtime.disaggregation.prefill_handoff import PrefillHandoff
from radixlm.runtime.disaggregation.transfer_backend import TcpDecodeLink, TcpPrefillLink
from radixlm.runtime.scheduler.request_memory import RequestMemory
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


def build_handoffs(args: ServerArgs, memory: RequestMemory, buffers: list[torch.Tensor]
                   ) -> tuple[PrefillHandoff | None, DecodeHandoff | None]:
    """(prefill handoff, decode handoff): the one of this server's mode, or neither (a
    unified server; the ``fake`` backend, whose pairs the scheduler serves unpaired).
    Raises ``ValueError`` when the bootstrap port cannot be bound or the mooncake backend
    cannot start."""
    mode = args.disaggregation_mode
    if mode == "null" or args.disaggregation_transfer_backend == "fake":
        return None, None
    layout = KVLayout.of(buffers, memory.page_size)
    timeout = args.disaggregation_timeout
    mooncake = args.disaggregation_transfer_backend == "mooncake"
    if mode == "decode":
        link = (MooncakeDecodeLink(args.host, buffers, args.disaggregation_ib_device)
                if mooncake else TcpDecodeLink(buffers))
        return None, DecodeHandoff(link, memory, layout, timeout)
    link = (MooncakePrefillLink(args.host, buffers, args.disaggregation_ib_device)
            if mooncake else TcpPrefillLink(args.host, buffers))
    port = args.disaggregation_bootstrap_port
    host = args.disaggregation_bootstrap_host or args.host
    secret = args.api_key or secrets.token_urlsafe(32)  # (without a key: the process's own)
    try:
        bootstrap = BootstrapServer(host, port, layout, secret)
    except OSError as err:
        link.close()
        raise ValueError(f"the bootstrap service cannot listen on {host}:{port} "
                         f"(--disaggregation-bootstrap-host, -port): {err}") from None
    ip, rank_port = link.endpoint.removeprefix("tcp://").rsplit(":", 1)
    register(f"{host}:{port}", {
        "role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0, "attn_dp_size": 1,
        "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
        "system_dp_rank": 0, "rank_ip": ip, "rank_port": int(rank_port),
    }, secret)
    logger.info("bootstrap service on %s:%d; KV requests at %s", host, port,
                link.endpoint)
    return PrefillHandoff(link, memory, layout, timeout, bootstrap=bootstrap), None
