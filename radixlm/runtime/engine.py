"""``radixlm.Engine``: the in-process, SGLang-compatible offline API.

    engine = Engine()                      # the default model
    out = engine.generate("The capital of France is", {"max_new_tokens": 16})
    for chunk in engine.generate("Tell me a story", stream=True): ...
    engine.shutdown()

All requests given to one ``generate`` call run together as one continuous batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixlm.models.default_model import resolve_model_path
from radixlm.models.model_config import ModelConfig
from radixlm.radix_cache.allocator import pages_for
from radixlm.radix_cache.no_cache import NoPrefixCache
from radixlm.radix_cache.radix_tree import RadixCache
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.request import LogprobRequest, Req
from radixlm.runtime.request_inputs import normalize_inputs
from radixlm.runtime.request_memory import RequestMemory
from radixlm.runtime.sampler import Sampler
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs


class Engine:
    """Loads a model and serves ``generate`` calls in this process.

    ``model_path``: a Hugging Face directory, a ``.gguf`` file, a hub id, or None for the
    default model (SmolLM2-135M-Instruct, fetched and converted on first use). Other
    keyword options are the fields of ``ServerArgs``.
    """

    def __init__(self, model_path: str | None = None, **options: Any):
        self.server_args = ServerArgs.from_kwargs(model_path, **options)
        path = resolve_model_path(self.server_args.model_path)
        self.model_config = ModelConfig.from_path(path, self.server_args.trust_remote_code)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            self.server_args.tokenizer_path or path
        )
        self.runner = ModelRunner(self.server_args, self.model_config)
        self.context_length = self.runner.context_length
        sampler = Sampler(
            self.model_config.vocab_size, self.model_config.eos_token_ids,
            self.server_args.random_seed,
        )
        processor = OutputProcessor(
            self.tokenizer, self.runner.compute_logits, self.model_config.eos_token_ids,
            self.context_length,
        )
        cache_class = NoPrefixCache if self.server_args.disable_radix_cache else RadixCache
        tree_cache = cache_class(self.runner.allocator, self.runner.allocator.page_size)
        self.memory = RequestMemory(
            self.runner.req_to_token_pool, self.runner.allocator, tree_cache
        )
        self.scheduler = Scheduler(self.runner, self.memory, processor, sampler, self.server_args)
        # Re-entrant: a caller may generate while holding an unfinished stream of its own.
        self._lock = threading.RLock()
        self._closed = False

    # The public API -----------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        extra_key: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generates for one prompt (a dict back) or a list of prompts (a list back).

        With ``stream=True`` returns an iterator of chunks whose ``text`` is cumulative; for a
        list of prompts each chunk carries its prompt's ``index``. ``extra_key`` is a
        prefix-cache namespace (a tenant, a LoRA): requests under different keys never
        share cached KV.
        """
        self._check_open()
        if extra_key is not None and not isinstance(extra_key, str):
            raise ValueError(f"extra_key must be a string, got {type(extra_key).__name__}")
        reqs, batched = self._make_requests(
            prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
            top_logprobs_num, return_text_in_logprobs, stream, rid,
        )
        for req in reqs:
            req.extra_key = extra_key
        if stream:
            return self._stream(reqs, batched)
        with self._lock:
            self._run(reqs)
        outputs = [self._output(req) for req in reqs]
        return outputs if batched else outputs[0]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for a chat, in the model's own chat template."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def abort(self, rid: str | None = None) -> int:
        """Aborts the unfinished request ``rid`` (all of them when None), freeing its KV at
        once; it ends with ``finish_reason`` type ``abort``. Returns how many were aborted."""
        with self._lock:
            victims = [r for r in self.scheduler.requests() if rid is None or r.rid == rid]
            for req in victims:
                self.scheduler.abort(req, "aborted by request" if rid else "aborted (abort all)")
            return len(victims)

    def flush_cache(self) -> bool:
        """Empties the prefix cache. Refused (returns False) while requests are in flight."""
        with self._lock:
            if not self.scheduler.is_idle():
                return False
            self.memory.flush()
            return True

    def get_server_info(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "model_path": str(self.model_config.path),
            "context_length": self.context_length,
            "max_total_tokens": runner.max_total_tokens,
            "kv_bytes_per_token": runner.kv_pool.bytes_per_token(),
            "available_kv_tokens": runner.allocator.available_size(),
            "page_size": runner.allocator.page_size,
            "cache_tokens": self.memory.tree_cache.total_size(),
            "schedule_policy": self.server_args.schedule_policy,
            "batching": self.server_args.batching,
            "chunked_prefill_size": self.server_args.chunked_prefill_size,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "device": str(runner.device),
        }

    def shutdown(self) -> None:
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # Internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine has been shut down")

    def _make_requests(
        self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
        top_logprobs_num, return_text_in_logprobs, stream, rid,
    ) -> tuple[list[Req], bool]:
        """Validates every input before any request is queued, so a bad one queues nothing."""
        inputs = normalize_inputs(
            prompt, input_ids, sampling_params, rid, self.tokenizer, self.context_length,
            self.model_config.vocab_size,
        )
        if top_logprobs_num is not None and (
            not isinstance(top_logprobs_num, int) or top_logprobs_num < 0
        ):
            raise ValueError(f"top_logprobs_num must be an integer >= 0, got {top_logprobs_num!r}")
        reqs = []
        for item in inputs:
            # The model's generation_config.json supplies defaults the request leaves out.
            params = SamplingParams.from_dict(
                {**self.model_config.generation_defaults, **(item.sampling_params or {})}
            )
            params.check_vocab(self.model_config.vocab_size)
            self._check_fits(item.input_ids, params)
            logprobs = None
            if return_logprob:
                start = self._logprob_start(logprob_start_len, len(item.input_ids))
                logprobs = LogprobRequest(start, top_logprobs_num or 0, return_text_in_logprobs)
            leader = None
            for sample in range(params.n):
                seed = params.sampling_seed
                sample_params = params if seed is None or sample == 0 else SamplingParams(
                    **{**params.__dict__, "sampling_seed": seed + sample}
                )
                reqs.append(req := Req(
                    rid=item.rid if params.n == 1 else f"{item.rid}-{sample}",
                    input_ids=item.input_ids,
                    sampling=sample_params,
                    detokenizer=IncrementalDetokenizer(
                        self.tokenizer, item.input_ids, params.skip_special_tokens,
                        params.spaces_between_special_tokens,
                    ),
                    logprobs=logprobs,
                    stream=stream,
                    prefill_leader=leader,
                ))
                leader = leader or req
        batched = inputs.batched or any(r.sampling.n > 1 for r in reqs)
        return reqs, batched

    def _check_fits(self, input_ids: list[int], params: SamplingParams) -> None:
        """Clamps the output budget to the context; refuses what the KV pool can never hold."""
        params.max_new_tokens = min(params.max_new_tokens, self.context_length - len(input_ids))
        need = pages_for(len(input_ids) + params.max_new_tokens, self.runner.allocator.page_size)
        pool = self.runner.max_total_tokens
        if need > pool:
            raise ValueError(
                f"the prompt ({len(input_ids)} tokens) plus max_new_tokens "
                f"({params.max_new_tokens}) needs {need} KV slots; the pool holds {pool} "
                "(raise max_total_tokens or lower max_new_tokens)"
            )

    @staticmethod
    def _logprob_start(logprob_start_len: int | None, prompt_len: int) -> int | None:
        if logprob_start_len is None or logprob_start_len == -1:
            return None
        if not isinstance(logprob_start_len, int) or not 0 <= logprob_start_len < prompt_len:
            raise ValueError(
                f"logprob_start_len must be -1 (output only) or in [0, {prompt_len}) for a "
                f"{prompt_len}-token prompt, got {logprob_start_len!r}"
            )
        return logprob_start_len

    def _run(self, reqs: list[Req]) -> None:
        """Steps the scheduler until every request of ``reqs`` has finished."""
        for req in reqs:
            self.scheduler.add_request(req)
        try:
            while not all(req.finished for req in reqs):
                self.scheduler.step()
        except BaseException:
            for req in reqs:
                self.scheduler.abort(req, "the engine failed while running this request")
            raise

    def _stream(self, reqs: list[Req], batched: bool) -> Iterator[dict[str, Any]]:
        """Yields a chunk per request whenever it gained tokens, and once more when it ends."""
        with self._lock:
            for req in reqs:
                self.scheduler.add_request(req)
            sent_tokens = [0] * len(reqs)
            done: set[int] = set()
            try:
                while len(done) < len(reqs):
                    for index, req in enumerate(reqs):
                        if index in done or (
                            not req.finished and len(req.output_ids) == sent_tokens[index]
                        ):
                            continue
                        sent_tokens[index] = len(req.output_ids)
                        if req.finished:
                            done.add(index)
                        chunk = self._output(req)
                        if batched:
                            chunk["index"] = index
                        yield chunk
                    if len(done) < len(reqs):
                        self.scheduler.step()
            finally:
                for req in reqs:
                    self.scheduler.abort(req, "the stream was closed before the request finished")

    def _output(self, req: Req) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "total_retractions": req.retractions,
            "e2e_latency": time.perf_counter() - req.created,
        }
        if req.logprobs is not None:
            meta["input_token_logprobs"] = req.input_token_logprobs
            meta["output_token_logprobs"] = req.output_token_logprobs
            if req.logprobs.top_k:
                meta["input_top_logprobs"] = req.input_top_logprobs
                meta["output_top_logprobs"] = req.output_top_logprobs
        return {"text": req.streamed_text(), "output_ids": list(req.output_ids), "meta_info": meta}
