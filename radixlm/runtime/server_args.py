"""The runtime's options: one dataclass shared by the Engine and the HTTP server.

Light to import: the Detokenizer's process and the CLI's parser load it, and neither needs
torch or the model code, which load here only when a method resolves the device or a
weight format.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from radixlm.runtime import device_choice
from radixlm.runtime.hicache_options import check_hicache_options
from radixlm.runtime.lora_options import check_lora_options
from radixlm.runtime.option_checks import check_positive
from radixlm.runtime.scale_out_options import check_scale_out_options
from radixlm.runtime.scheduling_options import check_scheduling_options
from radixlm.runtime.speculative.options import check_speculative_options

ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAMMAR_BACKENDS = ("xgrammar",)
REQUEST_CAPS = ("max_logprobs", "max_n", "max_samples_per_request", "max_prompt_logprob_entries",
                "max_stop_strings", "max_stop_chars", "max_stop_token_ids", "max_logit_bias",
                "max_request_parameter_entries",
                "max_constraint_chars")
"""The fields that bound what one request may ask for (``engine/request_caps.py``)."""


@dataclass
class ServerArgs:
    """Options of a radixlm runtime.

    Every field is validated in ``__post_init__``; a bad value raises ``ValueError`` naming
    the field and the allowed values.
    """

    model_path: str | None = None
    """A Hugging Face model directory, a ``.gguf`` file or a hub id; None: the default model."""
    tokenizer_path: str | None = None
    """The tokenizer's directory or hub id; None: the model's own."""
    dtype: str = "auto"
    """``auto``: bfloat16 on GPUs and on CPUs with native bf16, else float32 with the
    projections' and output head's weights stored in 16 bits (bfloat16 where that is exact,
    else float16; ``radixlm.models.layers.weight_storage``) where the fused CPU kernels run;
    ``float32`` keeps every weight in float32."""
    quantization: str | None = None
    """A weight-only format for the projections and the output head on CPUs: ``fp16wo``
    (half storage) or ``int8wo`` (int8, a scale per output row); computation stays in
    ``dtype`` (``radixlm.models.layers.weight_formats``). ``gguf`` (a ``.gguf`` model):
    the file's own formats, as a GGUF is served anyway (its block-quantized matrices as
    stored). None: weights in ``dtype``."""
    device: str = "auto"
    """``auto`` (CUDA when available, else the CPU), ``cpu`` or ``cuda[:N]``."""
    attention_backend: str = "auto"
    """``auto``: flashinfer, else triton, on CUDA; torch_native on CPUs (see
    ``radixlm.kernels.attention.backend_selection``)."""
    disable_cuda_graph: bool = False
    """Run GPU decode steps eagerly instead of replaying captured CUDA graphs."""
    cuda_graph_max_bs: int = 64
    """Largest decode batch captured as a CUDA graph; larger batches run eagerly."""
    enable_torch_compile: bool = False
    """On CPUs, decode batches of up to ``torch_compile_max_bs`` requests run the model's
    forward compiled by torch.compile (inductor, its artefacts cached on disk): matmuls and
    attention on the fused kernels as opaque operators, the small operations between them
    fused by inductor (``model_executor/compiled_decode.py``); compiled at start. On GPUs
    CUDA graphs serve decode and this is ignored, with a warning."""
    torch_compile_max_bs: int = 32
    """Largest decode batch run compiled; larger ones run eagerly."""
    disable_cpu_kernels: bool = False
    """On CPUs, run every operation through torch instead of the fused C++ kernels for the
    small operations between a forward pass's matmuls (``radixlm.kernels.cpu_ops.fused_ops``;
    built on the first start on a machine: a C++ compiler and ninja, some seconds)."""
    disable_cpu_weight_rows: bool = False
    """A bfloat16 model on a CPU gives the fused kernels a copy of each weight in their own
    layout (``models/layers/cpu_weight_layout.py``): on AVX-512 BF16 CPUs without AMX, column
    pairs in place of oneDNN's layout, for every pass; elsewhere the plain weight beside it,
    for decode passes of up to 4 rows (which doubles the projections' memory). This keeps
    oneDNN's layout alone and leaves every pass to oneDNN."""
    max_total_tokens: int | None = None
    """KV pool size in tokens; None: sized from ``kv_cache_memory_fraction``."""
    kv_cache_memory_fraction: float = 0.2
    """Share of the available memory given to the KV pool when ``max_total_tokens`` is None."""
    page_size: int = 1
    """Tokens per KV cache page: the unit the pool hands out and the prefix cache matches."""
    disable_radix_cache: bool = False
    """Compute every prompt in full (the baseline the prefix cache is measured against)."""
    enable_hierarchical_cache: bool = False
    """Keep prefixes the device pool evicts in host memory (and on disk with
    ``hicache_storage_backend``), and load them back (``kv_cache/hierarchical_cache.py``)."""
    hicache_ratio: float = 2.0
    """The host tier's size as a multiple of the device pool's tokens."""
    hicache_size: float = 0
    """The host tier's size in GB (0: by ``hicache_ratio``)."""
    hicache_write_policy: str = "write_back"
    """``write_back``: prefixes go to the host tier when the device pool evicts them;
    ``write_through``: as soon as they are cached."""
    hicache_storage_backend: str | None = None
    """``file``: a disk tier under ``hicache_storage_dir`` that outlives the server."""
    hicache_storage_dir: str = "/tmp/hicache"
    """The disk tier's directory (SGLang's file backend's default)."""
    hicache_storage_size: float = 16.0
    """The disk tier's capacity in GB (least recently used blocks go first)."""
    hicache_block_tokens: int = 32
    """Tokens of one block of the host and disk tiers (a multiple of ``page_size``)."""
    enable_lora: bool = False
    """Serve LoRA adapters (``models/lora``): requests name one (``lora_path``), batches mix
    them. Implied by ``lora_paths``."""
    lora_paths: list[str] | None = None
    """Adapters to load at start-up, as ``name=path`` (or a path, named by itself)."""
    max_loras_per_batch: int = 8
    """Most distinct adapters in one batch (device slots of the adapter pool)."""
    max_lora_rank: int | None = None
    """Highest adapter rank served (None: the highest of ``lora_paths``, at least 16)."""
    lora_target_modules: list[str] | None = None
    """Projections adapters may adapt (None: every one the model has of q/k/v/o_proj,
    gate/up/down_proj)."""
    max_running_requests: int = 64
    """Most requests decoded together in one batch."""
    context_length: int | None = None
    """Longest sequence (prompt + output); None: the model's ``max_position_embeddings``."""
    max_prefill_tokens: int = 8192
    """Most new prompt tokens computed in one step (the first request may exceed it)."""
    chunked_prefill_size: int | None = 1024
    """Prompts longer than this are prefilled chunk by chunk; None (or -1): never chunk."""
    chunked_prefill_step_ms: int | None = 250
    """Chunks are also cut to take about this long, by the measured prefill speed (on a
    CPU a 1,024-token chunk can take seconds, and everyone else waits for it; short
    prompts and decode steps run between chunks), four times as long while no other request
    runs or waits; None: cut by ``chunked_prefill_size`` alone."""
    schedule_policy: str = "lpm"
    """The order waiting requests are admitted in: ``lpm`` (longest cached prefix first),
    ``dfs-weight`` (depth-first over the prefix tree, heavier subtrees first), ``fcfs``
    (arrival order), ``lof`` (longest output budget first) or ``random``
    (``scheduler/schedule_policy.py``)."""
    batching: str = "continuous"
    """``continuous`` (iteration-level) or ``static`` (request-level, for comparison)."""
    init_new_token_ratio: float = 0.7
    """The share of running requests' remaining output budgets reserved in the KV pool
    when admitting new requests, at start (see ``new_token_ratio_decay``)."""
    min_new_token_ratio: float = 0.1
    """The lowest that share decays to."""
    new_token_ratio_decay: float = 0.001
    """Admission reserves ratio x remaining output budget for running requests; the ratio
    starts at init, decays per decode step to min, and returns to 1 after a retraction."""
    random_seed: int = 0
    """Seed of the sampler's generator, which draws for requests without a
    ``sampling_seed`` of their own."""
    num_threads: int | None = None
    """CPU threads for every forward pass; None: one thread or all of torch's, chosen per
    size of pass by measuring both as the server runs (``thread_policy.py``)."""
    disable_adaptive_timing: bool = False
    """Choose nothing by measuring time, so that a run repeats exactly: every CPU pass on
    all of torch's threads (unless ``num_threads``), prompts chunked by
    ``chunked_prefill_size`` alone (not paced by ``chunked_prefill_step_ms``), and float32
    passes of one row on torch's product (not the one measured faster at start)."""
    trust_remote_code: bool = False
    """Allow model and tokenizer code shipped with the checkpoint to run."""
    trust_request_chat_template: bool = False
    """Let a chat request bring its own Jinja template (``chat_template_kwargs``'s
    ``chat_template``). Off: such a request is refused, since a template is code the server
    runs (rendered off the event loop, with a time and size bound, where allowed)."""
    chat_template: str | None = None
    """The chat template to use instead of the tokenizer's: a Jinja file's path, or the name
    of one shipped in ``radixlm/chat_templates`` (``chatml-tools``: ChatML with tools, for
    models whose own template has none)."""
    tool_call_parser: str | None = None
    """How tool calls are read from the chat APIs' outputs (SGLang's parser names:
    ``output_parsing/tool_call_registry.py``); None: detected from the chat template."""
    reasoning_parser: str | None = None
    """How reasoning (``<think>...</think>``) is split from the chat APIs' outputs
    (``deepseek-r1``, ``qwen3``, ...); None: not split."""
    incremental_streaming_output: bool = False
    """Streamed ``/generate`` chunks carry each chunk's own text, ids and output logprobs
    (disjoint segments) instead of everything so far, as SGLang's option."""
    host: str = "127.0.0.1"
    """Where ``radixlm serve`` listens (loopback only, unless told otherwise)."""
    port: int = 30000
    """The port ``radixlm serve`` listens on."""
    served_model_name: str | None = None
    """The model's name in the OpenAI API; None: the model directory's name."""
    max_queued_requests: int | None = None
    """Requests accepted beyond ``max_running_requests``; more are refused (HTTP 503)."""
    api_key: str | None = None
    """When set, every HTTP route but /health requires ``Authorization: Bearer <key>``.
    ``radixlm serve`` also reads it from ``api_key_file`` or ``RADIXLM_API_KEY`` (a flag's
    value shows in ``ps``)."""
    api_key_file: str | None = None
    """A file whose first line is the API key."""
    health_timeout: float = 30.0
    """``/health`` answers 503 once the Scheduler has shown no sign of life (a finished step
    or its heartbeat) for this many seconds while requests wait on it."""
    shutdown_timeout: float = 30.0
    """On SIGTERM, seconds the requests in flight get to finish (new ones get 503) before
    the rest end with an error and the server stops."""
    grammar_backend: str = "xgrammar"
    """What compiles regex / json_schema / ebnf constraints into token masks."""
    disable_jump_forward: bool = False
    """Decode a grammar's forced text token by token instead of appending it at once."""
    speculative_algorithm: str | None = None
    """Speculative decoding (``scheduler/speculative_decode.py``): ``NGRAM`` drafts tokens
    from each request's own tokens and the radix tree, ``STANDALONE`` with a small draft
    model; the drafts are verified in one forward pass. None: off."""
    speculative_num_draft_tokens: int | None = None
    """Tokens one request's verify pass checks, its last one included (k drafted + 1), as
    SGLang counts them (None: ``speculative/options``)."""
    speculative_num_steps: int | None = None
    """A draft model's steps (tokens drafted) per verify (None: num_draft_tokens - 1)."""
    speculative_eagle_topk: int | None = None
    """Draft branches per step: 1 (chains) is all that is served."""
    speculative_draft_model_path: str | None = None
    """``STANDALONE``'s draft model: a directory, ``.gguf`` file or hub id of a model with
    the target's vocabulary."""
    speculative_ngram_min_match_window_size: int = 2
    """Shortest suffix of a request's tokens that an n-gram draft is matched on."""
    speculative_ngram_max_match_window_size: int = 8
    """Longest suffix of a request's tokens that an n-gram draft is matched on."""
    speculative_ngram_disable_radix_tree: bool = False
    """N-gram drafts from the requests' own tokens only, not from the radix tree."""
    speculative_ngram_max_bfs_breadth: int = 1
    """Branches of an n-gram draft: above 1, token trees of up to
    ``speculative_num_draft_tokens - 1`` nodes; 1: chains (SGLang's name)."""
    speculative_disable_by_batch_size: int | None = None
    """Running requests above which decode steps do not speculate (None:
    ``speculative/options``)."""
    max_logprobs: int = 20
    """Most top logprobs per position a request may ask for (vLLM's name and default)."""
    max_n: int = 128
    """Most samples per prompt (``n``), as OpenAI allows."""
    max_samples_per_request: int = 4096
    """Most prompts x ``n`` in one call."""
    max_prompt_logprob_entries: int = 131072
    """Most prompt positions with logprobs x (1 + top logprobs) per prompt."""
    max_stop_strings: int = 64
    """Most stop strings plus stop regexes per prompt."""
    max_stop_chars: int = 4096
    """Most characters of a prompt's stop strings and regexes together."""
    max_stop_token_ids: int = 1024
    """Most ``stop_token_ids`` per prompt (each of a call's samples carries them)."""
    max_logit_bias: int = 1024
    """Most ``logit_bias`` entries."""
    max_constraint_chars: int = 131072
    """Longest regex, JSON schema or EBNF constraint, in characters."""
    max_request_parameter_entries: int = 262144
    """Most stop token ids, ``logit_bias`` entries and stop characters of one call's samples
    (prompts x ``n``) together: each sample carries its own."""
    disaggregation_mode: str = "null"
    """Prefill/decode disaggregation (``runtime/disaggregation``): ``prefill`` servers
    compute prompts and send their KV to ``decode`` servers, which generate the rest;
    ``null``: both in one server. SGLang's router pairs them (``docs/scale_out.md``)."""
    disaggregation_bootstrap_host: str | None = None
    """Where a prefill server's bootstrap service listens; None: ``host``. Registering a
    rank there needs the server's ``api_key`` (``bootstrap.py``)."""
    disaggregation_bootstrap_port: int = 8998
    """Where a prefill server's bootstrap service listens (on ``host``): decode servers
    ask it where to fetch KV from."""
    disaggregation_transfer_backend: str = "tcp"
    """``tcp``: KV rows as ZMQ frames, between any two machines; ``mooncake``: written
    into the decode pool by Mooncake's transfer engine (optional dependency); ``fake``:
    nothing moves (the router's warm-up and health requests only)."""
    disaggregation_ib_device: str = ""
    """The InfiniBand device(s) the ``mooncake`` backend writes over (RDMA); empty: TCP."""
    disaggregation_timeout: float = 30.0
    """Seconds one half of a disaggregated request waits for the other (the decode
    side's slots, or the prefill side's KV) before it fails and frees what it holds."""
    tp_size: int = 1
    """Tensor parallelism: model ranks the model is split across (heads and MLP
    columns; ``model_executor/tensor_parallel_ranks``), each with its share of the KV."""
    nnodes: int = 1
    """Machines the ``tp_size`` ranks span (an equal share on each)."""
    node_rank: int = 0
    """This machine's place among ``nnodes``: node 0 serves; the others only host ranks."""
    dist_init_addr: str | None = None
    """host:port where the ranks meet (node 0's address); None on one node: a free
    loopback port."""
    dist_backend: str = "auto"
    """torch.distributed backend of the ranks' collectives: ``auto`` (NCCL on CUDA, gloo
    on CPUs), ``gloo`` or ``nccl``."""
    dist_timeout: float = 600.0
    """Seconds a rank waits in one collective, and for the others to join at start."""
    disable_overlap_schedule: bool | None = None
    """Run each decode step's forward pass, then its processing, strictly in turn, instead
    of processing one step while the next computes (see ``scheduler/overlap.py``). None:
    overlap on GPUs, the plain loop on CPUs, where the forward pass already uses every
    core and its Python would contend with the host's for the GIL (with the short OpenMP
    spin radixlm sets, decode ran faster without overlap on two cores:
    ``benchmarks/RESULTS.md``); False forces overlap there too."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self._check_quantization()
        check_positive("page_size", self.page_size)
        check_positive("cuda_graph_max_bs", self.cuda_graph_max_bs)
        check_positive("torch_compile_max_bs", self.torch_compile_max_bs)
        if self.max_queued_requests is not None and (
            not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0
        ):
            raise ValueError(
                f"max_queued_requests must be an integer >= 0, got {self.max_queued_requests!r}"
            )
        for name in ("shutdown_timeout", "health_timeout", "disaggregation_timeout",
                     "dist_timeout"):
            seconds = getattr(self, name)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                    seconds >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {seconds!r}")
        check_scale_out_options(self)
        check_speculative_options(self)
        check_hicache_options(self)
        check_lora_options(self)
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        check_positive("max_running_requests", self.max_running_requests)
        if self.max_total_tokens is not None:
            check_positive("max_total_tokens", self.max_total_tokens)
        if self.context_length is not None:
            check_positive("context_length", self.context_length)
        if self.num_threads is not None:
            check_positive("num_threads", self.num_threads)
        for name in REQUEST_CAPS:
            check_positive(name, getattr(self, name))
        if self.chunked_prefill_size == -1:  # SGLang's spelling of "no chunking"
            self.chunked_prefill_size = None
        check_scheduling_options(self)
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}"
            )
        if not 0.0 < self.kv_cache_memory_fraction < 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}"
            )

    def _check_quantization(self) -> None:
        if self.quantization is None:
            return
        from radixlm.models.layers.weight_formats import WEIGHT_FORMATS

        if self.quantization not in (*WEIGHT_FORMATS, "gguf"):
            raise ValueError(f"quantization must be one of {(*WEIGHT_FORMATS, 'gguf')} "
                             f"(or None), got {self.quantization!r}")
        if self.quantization == "gguf" and not str(self.model_path).lower().endswith(".gguf"):
            raise ValueError("quantization 'gguf' takes its format from a .gguf model file; "
                             f"model_path {self.model_path!r} is not one")
        if self.resolved_device().type != "cpu":
            raise ValueError(f"quantization {self.quantization!r} is a CPU weight format; "
                             f"device {self.device!r} is not a CPU")

    @classmethod
    def from_kwargs(cls, model_path: str | None = None, **options) -> ServerArgs:
        """Builds from keyword options, rejecting unknown ones by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown Engine options {unknown}; known options: {sorted(known)}")
        return cls(model_path=model_path, **options)

    def weight_format(self) -> str | None:
        """The weight-only format to pack the model into (``quantization``, with ``gguf``
        resolved from the file)."""
        if self.quantization == "gguf":  # a GGUF's matrices are served as the file stores them
            return None
        return self.quantization

    def overlap_schedule(self) -> bool:
        """Whether decode steps run ahead of their processing (``disable_overlap_schedule``
        resolved for the device)."""
        if self.disable_overlap_schedule is None:
            return self.resolved_device().type != "cpu"
        return not self.disable_overlap_schedule

    def resolved_device(self) -> torch.device:
        return device_choice.resolved_device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        return device_choice.resolved_dtype(self.dtype, self.resolved_device())

    def dtype_warning(self) -> str | None:
        """Why the chosen dtype is a poor choice on this machine, or None."""
        return device_choice.dtype_warning(self.dtype, self.resolved_device())
