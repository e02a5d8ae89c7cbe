"""Owns the model, its KV memory and the attention backend; runs one forward pass per batch."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from radixlm.host_to_device import to_device
from radixlm.kernels.attention.attention_backend import AttentionBackend
from radixlm.kernels.attention.backend_selection import (
    BackendRequest,
    create_backend,
    resolve_backend_name,
    triton_unavailable_reason,
)
from radixlm.kernels.cpu_ops import fused_ops
from radixlm.kernels.forward_batch import ForwardBatch, ForwardMode
from radixlm.kv_cache.allocator import TokenToKVPoolAllocator
from radixlm.kv_cache.memory_pool import (
    ReqToTokenPool,
    RowWriter,
    index_copy_rows,
)
from radixlm.models.layers.attention import PagedAttention
from radixlm.models.layers.moe_experts import StackedExperts
from radixlm.models.layers.tensor_parallel import SINGLE
from radixlm.models.layers.weight_storage import SIXTEEN_BIT_STORAGE
from radixlm.models.loader import load_model, validate_split
from radixlm.models.model_config import ModelConfig
from radixlm.runtime.lora.adapter_pool import LoraAdapterPool
from radixlm.runtime.model_executor.compiled_decode import (
    CompiledDecodeRunner,
    compile_decode,
)
from radixlm.runtime.model_executor.cpu_decode_runner import CpuDecodeRunner
from radixlm.runtime.model_executor.cpu_matmul_path import build_cpu_plan
from radixlm.runtime.model_executor.cuda_graph_runner import CudaGraphDecodeRunner
from radixlm.runtime.model_executor.device_setup import make_device_current
from radixlm.runtime.model_executor.kv_pool_layout import (
    build_hybrid_pools,
    kv_pool_tokens,
    plain_kv_pool,
    windowed_layout,
)
from radixlm.runtime.model_executor.rank_processes import LocalRanks
from radixlm.runtime.model_executor.tensor_parallel_ranks import (
    StepSender,
    agree_on_pool_size,
    init_ranks,
    loopback_address,
    threads_per_rank,
)
from radixlm.runtime.model_executor.thread_policy import ThreadPolicy
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

PROCESS_THREADS = torch.get_num_threads()
"""torch's CPU threads when this module was imported (before any pass changed a thread's)."""


class ModelRunner:
    """The model plus the memory it attends over.

    Pools are allocated here, once: ``max_total_tokens`` KV slots (rounded down to whole
    pages) and ``max_running_requests`` request rows of ``context_length`` entries.

    Its device is made the current CUDA device first (``device_setup``), so that graphs,
    Triton launches, events and workspaces land on it, not on GPU 0.

    With ``tp_size`` > 1 this is one rank (``rank``) of the model: rank 0, in the
    scheduler's process, starts this node's other ranks (``tp_worker``) and broadcasts
    every forward pass to them; all ranks agree on the pool's slot count.
    """

    def __init__(self, args: ServerArgs, model_config: ModelConfig, rank: int = 0):
        self.args = args
        self.model_config = model_config
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype()
        # On CPUs, unless --num-threads fixes it: one thread or all, by measurement.
        self.thread_policy = None
        self._fixed_threads = args.num_threads
        if args.tp_size > 1 and self._fixed_threads is None:
            self._fixed_threads = threads_per_rank(args.tp_size, args.nnodes)
        if (self._fixed_threads is None and self.device.type == "cpu"
                and not args.disable_adaptive_timing):
            self.thread_policy = ThreadPolicy(PROCESS_THREADS)
        self.context_length = args.context_length or model_config.max_position_embeddings
        self.tp, self.cpu_group = SINGLE, None
        self.local_ranks: LocalRanks | None = None
        self.step_sender: StepSender | None = None
        if args.tp_size > 1:
            self._join_ranks(model_config, rank)
        make_device_current(self.device)  # before anything else touches CUDA (device_setup)
        self.weight_format = args.weight_format()
        self.fused_cpu_kernels = self._use_fused_cpu_kernels()
        self.cpu_plan = build_cpu_plan(
            self.device, self.dtype, self.weight_format, self.fused_cpu_kernels,
            keep_rows=not args.disable_cpu_weight_rows, measure=not args.disable_adaptive_timing)
        """Which kernel runs each CPU product (``kernels/cpu_ops/execution_plan.py``)."""
        self.model = load_model(model_config, self.dtype, self.device, self.context_length,
                                self.tp, self.weight_format or self._auto_weight_storage(),
                                self.cpu_plan)
        self.lora = (LoraAdapterPool(self.model, model_config.num_layers,
                                     args.max_loras_per_batch, args.max_lora_rank,
                                     args.lora_target_modules, args.lora_paths, self.dtype,
                                     self.device) if args.enable_lora else None)
        """The LoRA adapters served (``runtime/lora/adapter_pool.py``), or None."""
        self.max_total_tokens, self.kv_memory_budget = kv_pool_tokens(
            args, model_config, self.dtype, self.device, self.attention_layer.num_kv_heads,
            self.context_length)
        """Pool tokens, and the memory budget they were sized by (None: given)."""
        if self.cpu_group is not None:
            self.max_total_tokens = agree_on_pool_size(self.max_total_tokens, self.cpu_group)
        page_size = args.page_size
        self.window_layout = windowed_layout(args, model_config, self.device,
                                             self.max_total_tokens, self.context_length)
        """The hybrid pool's layout where sliding layers keep only their window's KV, else
        None (``kv_pool_layout.py``)."""
        if self.window_layout is None:
            self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, page_size,
                                                    self.device)
            self.kv_pool = plain_kv_pool(  # (+ the padding page)
                model_config, self.allocator.size + page_size,
                self.attention_layer.num_kv_heads, self.dtype, self.device, self._row_writer())
        else:
            self.allocator, self.kv_pool = build_hybrid_pools(
                self.window_layout, self.max_total_tokens, page_size, model_config.num_layers,
                self.attention_layer.num_kv_heads, model_config.head_dim, self.dtype,
                self.device, self._row_writer())
        self.max_total_tokens = self.allocator.size
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests, self.context_length, self.device
        )
        self.attn_backend = self._make_attention_backend()
        self.fused_moe = self._use_fused_moe()
        self.cuda_graph_runner = self._make_cuda_graph_runner()
        self.cpu_decode_runner = (CpuDecodeRunner.build(self.model)
                                  if self.device.type == "cpu" else None)
        self.compiled_decode = self._make_compiled_decode()
        if self.tp.size > 1 and self.tp.rank == 0:
            self.step_sender = StepSender(self.tp, self.cpu_group, self.req_to_token_pool,
                                          args.dist_timeout)
            if self.lora is not None:  # the other ranks load the adapters rank 0 places
                self.lora.on_load = self.step_sender.send_lora_slot
        logger.info(
            "model %s loaded: %s%s on %s, KV pool of %d tokens (%.1f MiB)",
            model_config.architecture, self.dtype,
            f" (weights {self.weight_format})" if self.weight_format else "", self.device,
            self.max_total_tokens,
            self.max_total_tokens * self.kv_pool.bytes_per_token() / 2**20,
        )

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Runs the model over the batch's new tokens -> hidden states (T, hidden)."""
        # A pass with LoRA adapters adds their terms in its adapted projections (models/lora),
        # modules or fused CPU decode layers alike: never in a graph or a compiled pass.
        adapters = forward_batch.lora is not None
        if (not adapters and self.cuda_graph_runner is not None
                and self.cuda_graph_runner.can_run(forward_batch)):
            return self.cuda_graph_runner.replay(forward_batch)
        if self.step_sender is not None:  # the other ranks run the same pass
            self.step_sender.send_step(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        compiled = (not adapters and self.compiled_decode is not None
                    and self.compiled_decode.can_run(forward_batch))
        extend = forward_batch.mode is ForwardMode.EXTEND

        def run() -> torch.Tensor:
            with (torch.inference_mode(),
                  self.cpu_plan.pass_scope(len(forward_batch.input_ids), prompt=extend)):
                if compiled:  # (at the thread count it was compiled for)
                    hidden = self._run_compiled(forward_batch)
                    if hidden is not None:
                        return hidden
                if adapters:
                    self.lora.state.batch = forward_batch.lora
                try:
                    if self.cpu_decode_runner is not None and not extend:
                        return self.cpu_decode_runner.run(forward_batch)
                    return self.model(forward_batch.input_ids, forward_batch.positions,
                                      forward_batch)
                finally:
                    if adapters:
                        self.lora.state.batch = None

        if compiled or self.thread_policy is None:
            if self._fixed_threads is not None:
                self._set_threads(self._fixed_threads)
            return run()
        return self.thread_policy.run(len(forward_batch.input_ids), self._set_threads, run)

    @property
    def last_pass_was_trial(self) -> bool:
        """Whether the last eager CPU pass ran on a thread count the thread policy was
        trying, not on its choice: that pass's time says little of the usual pace."""
        return self.thread_policy is not None and self.thread_policy.last_was_trial

    def rank_failure(self) -> str | None:
        """Why the model's other ranks cannot serve (one exited), or None."""
        return None if self.local_ranks is None else self.local_ranks.failure()

    def lost_ranks(self, err: BaseException) -> str | None:
        """Why ``err``, raised by a step, means ranks on other nodes are gone (a collective
        failed: torch's distributed errors, or gloo's, which reach Python as a plain
        RuntimeError naming gloo), or None where it does not."""
        if self.cpu_group is None or self.args.nnodes < 2:
            return None
        if not (isinstance(err, dist.DistError) or "gloo" in str(err).lower()):
            return None
        per_node = self.args.tp_size // self.args.nnodes
        return (f"a collective with the tensor-parallel ranks of other nodes failed (ranks "
                f"{per_node}-{self.args.tp_size - 1}, nodes 1-{self.args.nnodes - 1}): {err}")

    def keep_ranks_alive(self) -> None:
        """Keeps the other ranks' wait for the next step from timing out; call it while
        no step is in flight (a dead rank raises ``RuntimeError`` here)."""
        if self.step_sender is not None:
            self.step_sender.keep_alive()

    def close(self) -> None:
        """Stops the other ranks (rank 0) and leaves the ranks' group."""
        if self.step_sender is not None:
            self.step_sender.shutdown()
        if self.local_ranks is not None:
            self.local_ranks.stop()
        if self.cpu_group is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.step_sender = self.local_ranks = self.cpu_group = None

    def _join_ranks(self, model_config: ModelConfig, rank: int) -> None:
        """Checks that the model splits into ``tp_size`` shares, starts this node's other
        ranks (on rank 0's node, when rank 0) and joins the ranks' group."""
        args = self.args
        validate_split(model_config, args.tp_size)
        if args.dist_init_addr is None:  # one node: rank 0 picks where the ranks meet
            args = self.args = dataclasses.replace(args, dist_init_addr=loopback_address())
        per_node = args.tp_size // args.nnodes
        if self.device.type == "cuda":  # one GPU per rank of a node
            self.device = torch.device("cuda", rank % per_node)
        if rank == 0 and per_node > 1:
            self.local_ranks = LocalRanks(args, str(model_config.path), range(1, per_node))
        try:
            self.tp, self.cpu_group = init_ranks(rank, args.tp_size, args.dist_init_addr,
                                                 args.dist_backend, self.device,
                                                 args.dist_timeout)
        except BaseException:
            if self.local_ranks is not None:
                self.local_ranks.stop(0)
            raise

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, H) -> float32 logits (N, vocab) (with the other ranks' shares)."""
        if self.step_sender is not None:
            self.step_sender.send_logits(hidden)
        if self.thread_policy is not None and self.thread_policy.last_was_trial:
            self._set_threads(self.thread_policy.last_choice)  # a trial times its pass only
        with torch.inference_mode(), self.cpu_plan.pass_scope(hidden.shape[0], prompt=False):
            return self.model.compute_logits(hidden)

    def make_forward_batch(
        self, mode: ForwardMode, input_ids: list[int], positions: list[int],
        out_cache_loc: torch.Tensor, req_pool_indices: list[int],
        prefix_lens: list[int], extend_lens: list[int],
    ) -> ForwardBatch:
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, self.device)

        return ForwardBatch(
            mode=mode,
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            out_cache_loc=out_cache_loc,
            req_pool_indices=as_tensor(req_pool_indices),
            seq_lens=as_tensor(seq_lens),
            prefix_lens=as_tensor(prefix_lens),
            extend_seq_lens=as_tensor(extend_lens),
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_list=seq_lens,
            extend_seq_lens_list=extend_lens,
        )

    def decode_inputs(self, input_ids: list[int], kv_lens: list[int],
                      req_pool_indices: list[int]) -> torch.Tensor:
        """(3, B) int64 on the device: a decode step's tokens, positions (each request's
        ``kv_len``) and request rows, in one copy to the device (on CUDA from pinned
        memory, without waiting for the kernels queued before it)."""
        return to_device([input_ids, kv_lens, req_pool_indices], torch.int64, self.device)

    def make_decode_batch(self, inputs: torch.Tensor, out_cache_loc: torch.Tensor,
                          kv_lens: list[int],
                          shared_prefixes: list[tuple[int, int, int]] | None = None
                          ) -> ForwardBatch:
        """A decode step's batch from ``decode_inputs``: one new token per request
        (``shared_prefixes``: see ``ForwardBatch``)."""
        input_ids, positions, req_pool_indices = inputs.unbind(0)
        batch_size = len(kv_lens)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=positions + 1,
            prefix_lens=positions,
            extend_seq_lens=torch.ones_like(positions),
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_list=[n + 1 for n in kv_lens],
            extend_seq_lens_list=[1] * batch_size,
            shared_prefixes=shared_prefixes or [],
        )

    def _set_threads(self, threads: int) -> None:
        """Sets the calling thread's CPU thread count: OpenMP keeps one per thread, and
        forward passes run on the scheduler's thread and on the decode worker's."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _row_writer(self) -> RowWriter:
        return fused_ops.active().scatter_rows if self.fused_cpu_kernels else index_copy_rows

    def _make_attention_backend(self) -> AttentionBackend:
        """The backend ``attention_backend`` names (``auto`` resolved for the device); one
        that cannot run here raises ValueError saying why (see ``backend_selection``)."""
        uses_mla = bool(getattr(self.model_config, "uses_mla", False))
        layer = self.attention_layer
        request = BackendRequest(self.args.attention_backend, self.device, self.dtype,
                                 layer.head_dim, uses_mla)
        self.attention_backend_name = resolve_backend_name(request)
        backend = create_backend(
            self.attention_backend_name, self.device, num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
            page_size=self.args.page_size, dtype=self.dtype, scaling=layer.scaling,
            cpu_plan=self.cpu_plan,
        )
        if uses_mla:
            backend.check_latent_heads(self.model_config.kv_lora_rank,
                                       self.model_config.qk_rope_head_dim, self.dtype,
                                       self.device)
        return backend

    def _use_fused_cpu_kernels(self) -> bool:
        """On CPUs (unless ``disable_cpu_kernels``) the layers' small operations run as fused
        kernels, for this process; False where they are off or cannot be built."""
        if self.device.type != "cpu" or self.args.disable_cpu_kernels:
            fused_ops.disable()
            return False
        return fused_ops.enable()

    def _auto_weight_storage(self) -> str | None:
        """``dtype=auto`` serving in float32 on a CPU with the fused kernels (which read
        16-bit weights in registers): the weights stored in 16 bits, half the bytes a decode
        step reads (``SIXTEEN_BIT_STORAGE``); else None (``--dtype float32`` keeps them
        float32)."""
        if (self.args.dtype == "auto" and self.dtype == torch.float32
                and self.fused_cpu_kernels):
            return SIXTEEN_BIT_STORAGE
        return None

    def _make_compiled_decode(self) -> CompiledDecodeRunner | None:
        """Decode compiled by torch.compile where ``enable_torch_compile`` asks for it
        (``compiled_decode``), else None."""
        if not self.args.enable_torch_compile:
            return None
        return compile_decode(
            self.model, self.device, padding_batch=self._padding_decode_batch,
            max_batch_size=min(self.args.torch_compile_max_bs, self.args.max_running_requests),
            threads=self._fixed_threads or PROCESS_THREADS, set_threads=self._set_threads)

    def _run_compiled(self, forward_batch: ForwardBatch) -> torch.Tensor | None:
        """The compiled decode step, or None where it failed (a recompile the warm-up did
        not foresee, or an error): decode is eager from then on, after one warning. The
        caller then runs the same batch eagerly: a pass that failed after some layers
        stored their K/V has the eager pass store the same K/V at the same slots again."""
        try:
            return self.compiled_decode.run(forward_batch)
        except Exception as err:  # noqa: BLE001 - any failure: the eager path still serves
            logger.warning("compiled decode failed (%s: %s); decode runs eagerly from now on",
                           type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self.compiled_decode = None
            return None

    def _padding_decode_batch(self, batch_size: int) -> ForwardBatch:
        """A decode batch of ``batch_size`` padding rows: request row 0, position 0, its K/V
        written into slot 0 (the allocator's reserved padding page)."""
        zeros = [0] * batch_size
        inputs = self.decode_inputs(zeros, zeros, zeros)
        slots = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        return self.make_decode_batch(inputs, slots, zeros)

    def _use_fused_moe(self) -> bool:
        """With a kernel backend (``uses_custom_kernels``), MoE experts run on the fused
        Triton kernel where Triton can run."""
        if not self.attn_backend.uses_custom_kernels:
            return False
        if triton_unavailable_reason(self.device) is not None:
            return False
        from radixlm.kernels.triton_ops.fused_moe import fused_experts

        experts = [m for m in self.model.modules()  # (packed experts keep their own path)
                   if isinstance(m, StackedExperts) and m.packed is None]
        for module in experts:
            module.computation = fused_experts
        return bool(experts)

    @property
    def attention_layer(self) -> PagedAttention:
        """The model's first attention layer (every layer shares its head layout)."""
        return next(m for m in self.model.modules() if isinstance(m, PagedAttention))

    def _make_cuda_graph_runner(self) -> CudaGraphDecodeRunner | None:
        """Captured decode graphs on CUDA with a backend that supports them, unless disabled."""
        if (
            self.device.type != "cuda"
            or self.args.disable_cuda_graph
            or self.tp.size > 1  # (a broadcast per pass cannot be captured)
            or not self.attn_backend.supports_cuda_graph
        ):
            return None
        if not self.fused_moe and any(
                isinstance(m, StackedExperts) for m in self.model.modules()):
            logger.warning("CUDA graphs are off: MoE experts without the fused kernel (no "
                           "Triton here) sync with the host, which a graph cannot capture")
            return None
        max_batch_size = min(self.args.cuda_graph_max_bs, self.args.max_running_requests)
        return CudaGraphDecodeRunner(
            self.model, self.attn_backend, self.kv_pool, self.req_to_token_pool.req_to_token,
            self.attention_layer, device=self.device, max_batch_size=max_batch_size,
            max_context_len=self.context_length,
        )

