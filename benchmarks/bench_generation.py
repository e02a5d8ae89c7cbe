"""radixlm vs transformers (and llama.cpp) on the default model: prefill, batch-1 decode,
batch-16 throughput, in each weight format.

Every system runs in this process on the same weights, alternating run by run (round r
runs every workload on every system before round r + 1), so the ratios hold on a shared,
noisy machine; medians of the rounds are printed. Absolute figures are for context only.

Systems:
- transformers, in the CPU's auto dtype (bfloat16 with native bf16, else float32), with
  torch's default threads (its reference configuration) and, like radixlm's processes, the
  OpenMP wait radixlm sets on import (a short spin, see ``radixlm/__init__.py``);
- radixlm in the auto dtype (on CPUs without native bf16: float32 over 16-bit weights),
  and with each ``--formats`` weight format (``fp16wo``, ``int8wo``); with ``--float32``
  also in float32 with float32 weights ("radixlm float32"); with ``--torch-ops`` also
  without its fused CPU kernels (``disable_cpu_kernels``, "radixlm torch ops"); with
  ``--torch-compile`` also with its decode compiled by torch.compile ("radixlm compiled":
  torch's operations, fused by inductor);
- llama.cpp through ``llama-cpp-python`` (optional, benchmark-only) on the GGUF files given
  (``--gguf-f16``, ``--gguf-q8``: the same weights converted by llama.cpp's
  ``convert_hf_to_gguf.py --outtype f16 / q8_0``); its batch of 16 runs sequentially.

Prompts differ in every run, so no system reuses a cached prefix.

    python benchmarks/bench_generation.py [--rounds 3] [--formats fp16wo int8wo]
        [--float32] [--torch-ops] [--torch-compile]
        [--gguf-f16 smol-f16.gguf --gguf-q8 smol-q8_0.gguf [--llama-no-extra-buffers]]
"""
# ruff: noqa: I001 - radixlm is imported before torch, for the reason given there

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# First: importing radixlm sets its OpenMP wait, which must precede torch's loading to
# apply to transformers in this process too.
import radixlm

import torch
import transformers
from machine import describe_machine

from radixlm.models.default_model import default_model_path
from radixlm.runtime.server_args import ServerArgs

BATCH = 16
WARM_UP_ROUNDS = 2
"""Unmeasured rounds first, at full length. radixlm's CPU thread policy tries one thread
once on each size of pass it meets, and its prefill pace chunks prompts until it has timed
one: after one short warm-up round, the first measured round still ran a 512-token prompt
as two chunks, the second on one thread (564 ms against 320), and the batch's prefill on
one thread (200 ms against 100), so each median was the lower of the other two rounds."""
_run_ids = itertools.count()


def prompts(tokenizer, count: int, length: int | None = None) -> list[list[int]]:
    """``count`` prompts never seen before (a fresh first word); ``length`` tokens each, or
    a short instruction."""
    run = next(_run_ids)
    texts = [f"Note {run}-{i}: the history of the city of Paris" for i in range(count)]
    ids = [tokenizer(text)["input_ids"] for text in texts]
    if length is not None:
        filler = tokenizer(" and its rivers, bridges and streets" * (length // 6))["input_ids"]
        ids = [(p + filler)[:length] for p in ids]
    return ids


class Radixlm:
    def __init__(self, path: str, quantization: str | None, torch_ops: bool = False,
                 compiled: bool = False, dtype: str = "auto"):
        self.name = ("radixlm" + (f" {quantization}" if quantization else "")
                     + (f" {dtype}" if dtype != "auto" else "")
                     + (" torch ops" if torch_ops else "") + (" compiled" if compiled else ""))
        self.engine = radixlm.Engine(path, quantization=quantization, max_total_tokens=16384,
                                     dtype=dtype,
                                     disable_cpu_kernels=torch_ops,
                                     enable_torch_compile=compiled)

    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        outputs = self.engine.generate(input_ids=batch, sampling_params=params)
        assert all(len(o["output_ids"]) == new_tokens for o in outputs)

    def close(self) -> None:
        self.engine.shutdown()


class Transformers:
    def __init__(self, path: str, dtype: torch.dtype, tokenizer):
        self.name = "transformers"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(self, batch: list[list[int]], new_tokens: int) -> None:
        width = max(map(len, batch))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.pad)
        assert out.shape[1] - width == new_tokens

    def close(self) -> None:
        del self.model


class LlamaCpp:
    """llama.cpp in a child process of its own, at its best: OpenMP threads left to spin as
    long as they like (a passive wait halves its two-thread decode) and no torch in the
    process. Lines of JSON in, elapsed seconds out."""

    def __init__(self, gguf: str, label: str, extra_buffers: bool):
        self.name = f"llama.cpp {label}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        worker = [sys.executable, str(Path(__file__).with_name("llama_cpp_worker.py")), gguf]
        self.child = subprocess.Popen(
            worker + ([] if extra_buffers else ["--no-extra-buffers"]),
            env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def generate(self, batch: list[list[int]], new_tokens: int) -> float:
        self.child.stdin.write(json.dumps({"batch": batch, "new_tokens": new_tokens}) + "\n")
        self.child.stdin.flush()
        line = self.child.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with code {self.child.wait()} "
                               "(see llama_cpp_worker.py for --llama-no-extra-buffers)")
        return float(line)

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait(timeout=60)


def timed(system, batch: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    seconds = system.generate(batch, new_tokens)
    return seconds if seconds is not None else time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", nargs="*", default=["fp16wo", "int8wo"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--gguf-f16", default=None, help="llama.cpp's F16 GGUF of the model")
    parser.add_argument("--gguf-q8", default=None, help="llama.cpp's Q8_0 GGUF of the model")
    parser.add_argument("--llama-no-extra-buffers", action="store_true",
                        help="llama.cpp without its repacked weight layouts (see "
                             "llama_cpp_worker.py: Q8_0 crashes with them on AMX CPUs)")
    parser.add_argument("--float32", action="store_true",
                        help="also radixlm in float32 with float32 weights")
    parser.add_argument("--torch-ops", action="store_true",
                        help="also radixlm without its fused CPU kernels (torch's operations)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also radixlm with its decode compiled by torch.compile")
    parser.add_argument("--workloads", nargs="+", default=["prefill", "decode", "batch"],
                        choices=["prefill", "decode", "batch"])
    args = parser.parse_args()
    path = str(default_model_path())
    dtype = ServerArgs(device="cpu").resolved_dtype()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    systems = [Transformers(path, dtype, tokenizer), Radixlm(path, None)]
    systems += [Radixlm(path, name) for name in args.formats]
    if args.float32:
        systems.append(Radixlm(path, None, dtype="float32"))
    if args.torch_ops:
        systems.append(Radixlm(path, None, torch_ops=True))
    if args.torch_compile:
        systems.append(Radixlm(path, None, compiled=True))
    for gguf, label in ((args.gguf_f16, "F16"), (args.gguf_q8, "Q8_0")):
        if gguf:
            systems.append(LlamaCpp(gguf, label, not args.llama_no_extra_buffers))
    workloads = {  # name: (batch size, prompt tokens, new tokens, counts prompt tokens)
        f"prefill {args.prompt_tokens} tok/s": (1, args.prompt_tokens, 1, True),
        "decode b1 tok/s": (1, None, args.decode_tokens, False),
        f"batch {BATCH} out tok/s": (BATCH, None, args.batch_tokens, False),
    }
    workloads = {name: spec for name, spec in workloads.items()
                 if name.split()[0] in args.workloads}
    print(describe_machine())
    print(f"model {path}; auto dtype {dtype}; {args.rounds} rounds, medians")
    for _ in range(WARM_UP_ROUNDS):  # first passes, thread choices, prefill pace
        for system in systems:
            for batch, length, new_tokens, _ in workloads.values():
                system.generate(prompts(tokenizer, batch, length), new_tokens)
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for workload, (batch, length, new_tokens, by_prompt) in workloads.items():
            for system in systems:
                batch_ids = prompts(tokenizer, batch, length)
                seconds = timed(system, batch_ids, new_tokens)
                tokens = batch * (length if by_prompt else new_tokens)
                rates.setdefault((workload, system.name), []).append(tokens / seconds)
    header = f"{'system':<18}" + "".join(f"{w:>24}" for w in workloads)
    print(header)
    medians = {key: statistics.median(values) for key, values in rates.items()}
    for system in systems:
        cells = []
        for workload in workloads:
            ours, base = medians[(workload, system.name)], medians[(workload, "transformers")]
            cells.append(f"{ours:>12.1f} ({ours / base:>5.2f}x)")
        print(f"{system.name:<18}" + "".join(f"{c:>24}" for c in cells))
    print("(x: against transformers in the same column)")
    pairs = [("radixlm", "llama.cpp F16"), ("radixlm float32", "llama.cpp F16"),
             ("radixlm fp16wo", "llama.cpp F16"),
             ("radixlm int8wo", "llama.cpp Q8_0")]
    names = {system.name for system in systems}
    for ours, theirs in pairs:
        if ours in names and theirs in names:
            ratios = [medians[(w, ours)] / medians[(w, theirs)] for w in workloads]
            print(f"{ours} / {theirs}: " + ", ".join(
                f"{w.rsplit(' ', 1)[0]} {r:.2f}x" for w, r in zip(workloads, ratios)))
    for system in systems:
        system.close()


if __name__ == "__main__":
    main()
