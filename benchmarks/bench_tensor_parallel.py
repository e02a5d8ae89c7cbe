"""Tensor parallelism on this machine: one rank against two, side by side in one run.

Writes a randomly initialised Llama of about 0.5B parameters in bfloat16 (the default
model's tokenizer, 24 layers of width 1024), then, in alternating rounds, serves it with
``tp_size`` 1 and 2 on gloo: prefill throughput (prompts of ``--prompt-len`` tokens, one
new token) and decode throughput (a batch of short prompts, ``--new-tokens`` each; the
time of the one-token run subtracted). Apart, it times the all-reduces one step needs (two
per layer) between two gloo processes, for a decode step's and a prefill's hidden states.

On a CPU the two ranks share the machine's cores (each gets half) and pay the all-reduces
on top, so two ranks are expected to be slower here; the point is the mechanism's cost,
and that the split runs. On a GPU machine with one GPU only tp=1 can run.

    python benchmarks/bench_tensor_parallel.py [--rounds 2] [--prompt-len 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from machine import cpu_flags  # noqa: E402

import radixlm  # noqa: E402
from radixlm.models.default_model import default_model_path  # noqa: E402
from radixlm.runtime.model_executor.tensor_parallel_ranks import loopback_address  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 1024, 24, 16, 8, 4096
PREFILL_PROMPTS, DECODE_BATCH = 4, 4


def write_model(directory: Path) -> Path:
    """A random ~0.5B Llama with the default model's tokenizer, in bfloat16."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN,
                         intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def throughput(path: Path, tp: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Prefill and decode tokens per second of one engine with ``tp`` ranks."""
    g = torch.Generator().manual_seed(tp)
    long = [torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
            for _ in range(PREFILL_PROMPTS)]
    short = [torch.randint(100, 40000, (16,), generator=g).tolist() for _ in range(DECODE_BATCH)]
    with radixlm.Engine(str(path), dtype="bfloat16", tp_size=tp, max_total_tokens=8192,
                        disable_radix_cache=True) as engine:
        engine.generate(input_ids=short, sampling_params={"max_new_tokens": 2})  # warm-up
        start = time.perf_counter()
        engine.generate(input_ids=long, sampling_params={"max_new_tokens": 1})
        prefill = time.perf_counter() - start
        times = {}
        for count in (1, 1 + new_tokens):
            start = time.perf_counter()
            engine.generate(input_ids=short, sampling_params={
                "max_new_tokens": count, "ignore_eos": True})
            times[count] = time.perf_counter() - start
    decode = times[1 + new_tokens] - times[1]
    return {"prefill_tok_s": PREFILL_PROMPTS * prompt_len / prefill,
            "decode_tok_s": DECODE_BATCH * new_tokens / decode}


def _all_reduce_rank(rank: int, address: str, tokens: int, repeats: int, out) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank,
                            world_size=2)
    x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    for _ in range(3):
        dist.all_reduce(x)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(2 * LAYERS):  # after attention and after the MLP, every layer
            dist.all_reduce(x)
        samples.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(samples))
    dist.destroy_process_group()


def all_reduce_ms_per_step(tokens: int, repeats: int = 5) -> float:
    """Milliseconds of one step's all-reduces (2 per layer) of ``tokens`` hidden rows."""
    context = mp.get_context("spawn")
    out = context.Queue()
    address = loopback_address()
    ranks = [context.Process(target=_all_reduce_rank, args=(r, address, tokens, repeats, out))
             for r in range(2)]
    for process in ranks:
        process.start()
    seconds = out.get(timeout=300)
    for process in ranks:
        process.join()
    return seconds * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench_tp_"))
    try:
        path = write_model(directory)
        rounds: dict[int, list[dict]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for tp in rounds:
                rounds[tp].append(throughput(path, tp, args.prompt_len, args.new_tokens))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} cores; random Llama, {LAYERS} layers "
          f"x {HIDDEN} (~0.5B parameters), bfloat16, gloo; medians of {args.rounds} rounds")
    medians = {tp: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
               for tp, runs in rounds.items()}
    print(f"{'':8}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for tp, m in medians.items():
        print(f"tp={tp:<5}{m['prefill_tok_s']:15.1f}{m['decode_tok_s']:15.1f}")
    print(f"{'tp2/tp1':8}{medians[2]['prefill_tok_s'] / medians[1]['prefill_tok_s']:14.2f}x"
          f"{medians[2]['decode_tok_s'] / medians[1]['decode_tok_s']:14.2f}x")
    for label, tokens in (("decode step", DECODE_BATCH), ("prefill", PREFILL_PROMPTS *
                                                          args.prompt_len)):
        print(f"all-reduces of one {label} ({tokens} rows, {2 * LAYERS} calls): "
              f"{all_reduce_ms_per_step(tokens):.2f} ms")


if __name__ == "__main__":
    main()
