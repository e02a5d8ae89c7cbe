"""Beam search on the default model (float32): radixlm vs transformers vs a re-prefill loop.

Three ways to find the k best continuations of one long prompt (``num_beams=k,
num_return_sequences=k, do_sample=False``):

- radixlm: one ``Engine.generate`` with ``use_beam_search`` and ``n=k``. The prompt is
  prefilled once and its KV shared by the k beams; a beam that forks shares its parent's KV.
- transformers: ``generate(num_beams=k)``, which copies the prompt k times before its
  prefill and keeps k full KV caches, reordered every step.
- a re-prefill loop, as vLLM runs beam search today: each step sends the k beams to radixlm as
  k requests (prompt + the beam's tokens, one new token, the 2k top logprobs) and does the
  beam bookkeeping in Python; radixlm's prefix cache spares it recomputing the prefixes, but
  each step is a round trip and a prefill step rather than a decode step.

Reported per width: finished sequences per second (k per search; median of interleaved
rounds), the ratios radixlm / other, and the peak KV each held. radixlm's peak is its
``peak_kv_tokens`` after a ``flush_cache`` (the loop's includes every branch its cache kept)
times ``kv_bytes_per_token``; transformers' is its k caches at the end, k x (prompt +
output) tokens of 2 x layers x kv_heads x head_dim float32s. Whether the three found the same
best sequence is printed beside them.

    python benchmarks/bench_beam_search.py [--rounds 3] [--widths 4 8] [--prompt-tokens 512]
        [--max-new-tokens 32]
"""

# ruff: noqa: I001 - radixlm is imported before torch, for the reason given there

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


# First: importing radixlm sets its OpenMP wait (radixlm/__init__.py), which must precede
# torch's loading to apply to this process (transformers included) and its servers.
import radixlm  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from machine import cpu_flags  # noqa: E402

from radixlm.models.default_model import default_model_path  # noqa: E402

DTYPE = "float32"
SYSTEMS = ("radixlm", "transformers", "re-prefill loop")


def peak_kv_tokens(engine: radixlm.Engine) -> int:
    """The most KV slots in use at once since the last ``flush_cache``."""
    return engine.get_server_info()["peak_kv_tokens"]


def radixlm_search(engine: radixlm.Engine, prompt: list[int], width: int,
                   new_tokens: int) -> tuple[list[list[int]], int]:
    """(the k sequences best first, peak KV tokens) of one beam search from a flushed cache."""
    engine.flush_cache()
    outs = engine.generate(input_ids=prompt, sampling_params={
        "use_beam_search": True, "n": width, "max_new_tokens": new_tokens})
    return [o["output_ids"] for o in outs], peak_kv_tokens(engine)


def transformers_search(model, prompt: list[int], width: int, new_tokens: int, eos: int,
                        threads: int) -> list[list[int]]:
    torch.set_num_threads(threads)  # an in-process engine may have changed it
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                             num_return_sequences=width, do_sample=False,
                             max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos)
    sequences = []
    for row in out[:, len(prompt):].tolist():
        sequences.append(row[: row.index(eos) + 1] if eos in row else row)
    return sequences


def reprefill_search(engine: radixlm.Engine, prompt: list[int], width: int,
                     new_tokens: int, eos: int) -> tuple[list[list[int]], int]:
    """vLLM's ``LLM.beam_search`` loop over radixlm: each step, every beam's best 2k next
    tokens; the best k that are not EOS run on, EOS ones are complete; at the end the
    complete and running beams are ranked by logprob sum / length (length penalty 1)."""
    engine.flush_cache()
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    complete: list[tuple[list[int], float]] = []
    for _ in range(new_tokens):
        outs = engine.generate(
            input_ids=[prompt + tokens for tokens, _ in beams],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True},
            return_logprob=True, top_logprobs_num=2 * width)
        candidates = []
        for (tokens, score), out in zip(beams, outs):
            for logprob, token, *_ in out["meta_info"]["output_top_logprobs"][0]:
                (complete if token == eos else candidates).append(
                    (tokens + [token], score + logprob))
        beams = sorted(candidates, key=lambda beam: beam[1], reverse=True)[:width]
    ranked = sorted(complete + beams, key=lambda beam: beam[1] / len(beam[0]), reverse=True)
    return [tokens for tokens, _ in ranked[:width]], peak_kv_tokens(engine)


def compare(engine, model, prompt, width, args, eos, threads, kv_bytes, hf_kv_bytes) -> None:
    seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    best: dict[str, list[int]] = {}
    peaks: dict[str, int] = {}
    for _ in range(args.rounds):  # interleaved, round by round
        start = time.perf_counter()
        found, peaks["radixlm"] = radixlm_search(engine, prompt, width, args.max_new_tokens)
        seconds["radixlm"].append(time.perf_counter() - start)
        best["radixlm"] = found[0]
        start = time.perf_counter()
        found = transformers_search(model, prompt, width, args.max_new_tokens, eos, threads)
        seconds["transformers"].append(time.perf_counter() - start)
        best["transformers"] = found[0]
        start = time.perf_counter()
        found, peaks["re-prefill loop"] = reprefill_search(engine, prompt, width,
                                                           args.max_new_tokens, eos)
        seconds["re-prefill loop"].append(time.perf_counter() - start)
        best["re-prefill loop"] = found[0]
    rate = {name: width / statistics.median(runs) for name, runs in seconds.items()}
    peak_mb = {"radixlm": peaks["radixlm"] * kv_bytes / 2**20,
               "transformers": width * (len(prompt) + args.max_new_tokens) * hf_kv_bytes / 2**20,
               "re-prefill loop": peaks["re-prefill loop"] * kv_bytes / 2**20}
    for name in SYSTEMS:
        ratio = "" if name == "radixlm" else f"{rate['radixlm'] / rate[name]:>9.2f}x"
        same = "-" if name == "radixlm" else ("yes" if best[name] == best["radixlm"] else "NO")
        print(f"{width:>5} {name:<16} {rate[name]:>9.2f} {ratio:>10} {peak_mb[name]:>12.1f} "
              f"{same:>12}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = default_model_path()
    threads = torch.get_num_threads()
    config = transformers.AutoConfig.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads)
    hf_kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    eos = config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0]
    rng = random.Random(args.seed)
    # Ids above the special tokens (SmolLM2 keeps its 17 specials at the start).
    prompt = [rng.randrange(100, config.vocab_size) for _ in range(args.prompt_tokens)]
    print(f"cpu: {os.cpu_count()} cores, flags {cpu_flags()}, transformers on {threads} "
          f"threads; model {path}, {DTYPE}; prompt {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new; median of {args.rounds} interleaved rounds")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, DTYPE)).eval()
    budget = args.prompt_tokens + max(args.widths) * (args.max_new_tokens + 1)
    # Room for the loop's cache of every branch (2k per step) as well.
    engine = radixlm.Engine(str(path), dtype=DTYPE, max_total_tokens=4 * budget)
    try:
        kv_bytes = engine.get_server_info()["kv_bytes_per_token"]
        warm = prompt[:32]  # warm-up: every path once, briefly
        radixlm_search(engine, warm, 2, 2)
        transformers_search(model, warm, 2, 2, eos, threads)
        reprefill_search(engine, warm, 2, 2, eos)
        print(f"{'width':>5} {'system':<16} {'seqs/s':>9} {'radixlm is':>10} "
              f"{'peak KV MiB':>12} {'same best?':>12}")
        for width in args.widths:
            compare(engine, model, prompt, width, args, eos, threads, kv_bytes, hf_kv_bytes)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
