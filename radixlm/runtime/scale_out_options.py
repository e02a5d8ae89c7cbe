"""The scale-out options' checks: tensor parallelism over ranks and nodes, and
prefill/decode disaggregation (light: the CLI's parser reads them).
"""

from __future__ import annotations

from radixlm.runtime.option_checks import check_positive

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp", "mooncake", "fake")
DIST_BACKENDS = ("auto", "gloo", "nccl")


def check_scale_out_options(args) -> None:
    """Raises ``ValueError`` naming the option that is out of range or does not combine
    (``args``: the ``ServerArgs``)."""
    if args.disaggregation_mode not in DISAGGREGATION_MODES:
        raise ValueError(f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, "
                         f"got {args.disaggregation_mode!r}")
    if args.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
        raise ValueError(f"disaggregation_transfer_backend must be one of "
                         f"{TRANSFER_BACKENDS}, got {args.disaggregation_transfer_backend!r}")
    if not 0 < args.disaggregation_bootstrap_port < 65536:
        raise ValueError("disaggregation_bootstrap_port must be in 1..65535, got "
                         f"{args.disaggregation_bootstrap_port}")
    for name in ("tp_size", "nnodes"):
        check_positive(name, getattr(args, name))
    if args.tp_size % args.nnodes:
        raise ValueError(f"tp_size ({args.tp_size}) must be a multiple of nnodes "
                         f"({args.nnodes}): each node hosts an equal share of the ranks")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node_rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (host:port of node 0)")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"dist_init_addr must be host:port, got {args.dist_init_addr!r}")
    if not args.dist_timeout > 0:
        raise ValueError(f"dist_timeout must be > 0 seconds, got {args.dist_timeout!r}")
    if args.dist_backend not in DIST_BACKENDS:
        raise ValueError(f"dist_backend must be one of {DIST_BACKENDS}, "
                         f"got {args.dist_backend!r}")
    if args.tp_size > 1 and args.disaggregation_mode != "null":
        raise ValueError("tensor parallelism (tp_size > 1) and disaggregation_mode "
                         f"{args.disaggregation_mode!r} do not combine yet")
    if args.enable_torch_compile and args.tp_size > 1 and args.resolved_device().type == "cpu":
        raise ValueError("enable_torch_compile and tensor parallelism (tp_size > 1) do "
                         "not combine yet")
