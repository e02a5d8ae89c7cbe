"""radixlm vs llama.cpp (``llama-cpp-python``) on the same quantized GGUF files: batch-1
decode, a 512-token prefill, a batch of 16, and resident memory, default options both sides.

Each system runs in a child process of its own (llama.cpp in ``llama_cpp_worker.py``,
without torch; radixlm in this script's ``--worker`` mode, an ``Engine`` with its scheduler
and detokenizer processes), alternating workload by workload, round by round, so ratios
hold on a shared, noisy machine; medians of the rounds are printed. Resident memory is the
sum over a system's process tree (``psutil``), sampled after every workload; the largest is
reported, as RSS (what the criterion compares: pages shared between processes, such as
torch's libraries, counted in each) and as PSS (each shared page split between its
processes: what the tree costs the machine). llama.cpp decodes a batch one sequence after
another (llama-cpp-python's ``Llama`` has one sequence); radixlm batches it.

Models: the public gemma-3-270m Q4_K_M (tests/gemma3_file.py) and a Q4_K_M of the default
model made here by llama.cpp's own quantizer (``llama_model_quantize``) from an F32 GGUF of
the default model's weights (its Q4_1 file dequantized by ``gguf``, metadata kept).

    pip install -e ".[dev,bench]"
    python benchmarks/bench_gguf.py [--rounds 3] [--models gemma3 smollm2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from bench_generation import LlamaCpp
from machine import cpu_flags, openmp_setting

PREFILL, DECODE, BATCH, BATCH_NEW = 512, 64, 16, 32
WORKLOADS = {  # name -> (sequences, prompt tokens, new tokens, tokens counted)
    "prefill 512": (1, PREFILL, 1, PREFILL),
    "decode batch 1": (1, 16, DECODE + 1, DECODE),
    "batch 16": (BATCH, 16, BATCH_NEW, BATCH * BATCH_NEW),
}


class RadixlmChild:
    """radixlm's side: this script in ``--worker`` mode, JSON lines in, seconds out."""

    def __init__(self, gguf: str):
        self.name = "radixlm"
        self.child = subprocess.Popen([sys.executable, __file__, "--worker", gguf], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    generate = LlamaCpp.generate
    close = LlamaCpp.close


def worker(gguf: str) -> None:
    """An Engine over ``gguf`` with default options; each request greedy, ignoring EOS."""
    import radixlm

    engine = radixlm.Engine(gguf)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = {"max_new_tokens": request["new_tokens"], "temperature": 0.0,
                  "ignore_eos": True}
        start = time.perf_counter()
        engine.generate(input_ids=request["batch"], sampling_params=params)
        print(time.perf_counter() - start, flush=True)
    engine.shutdown()


def tree_memory(pid: int) -> tuple[int, int]:
    """Resident bytes (RSS, PSS) of a process and all its descendants."""
    root = psutil.Process(pid)
    rss = pss = 0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            memory = process.memory_full_info()
            rss, pss = rss + memory.rss, pss + memory.pss
    return rss, pss


def prompts(round_: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """Fresh token ids (no cached prefix between runs): a run-specific start, then filler."""
    return [[2] + [(1000 + 7919 * (round_ * 97 + i) + 31 * j) % (vocab - 2000) + 1000
                   for j in range(length - 1)] for i in range(count)]


def smollm2_q4_k_m(cache: Path) -> Path:
    """The default model as Q4_K_M, made once by llama.cpp's quantizer."""
    import gguf
    import llama_cpp
    import numpy as np

    from radixlm.models.default_model import fetch_default_gguf

    target = cache / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    source = gguf.GGUFReader(fetch_default_gguf(cache))
    f32 = cache / "SmolLM2-135M-Instruct.F32.gguf"
    writer = gguf.GGUFWriter(f32, arch=source.fields["general.architecture"].contents())
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    for tensor in source.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(target).encode(), params) != 0:
        raise RuntimeError("llama.cpp could not quantize the default model")
    f32.unlink()
    return target


def bench(gguf: Path, rounds: int, extra_buffers: bool) -> dict:
    """Medians of each workload's seconds, and the largest resident memory, per system."""
    import gguf as gguf_package

    vocab = len(gguf_package.GGUFReader(gguf).fields["tokenizer.ggml.tokens"].data)
    systems = [LlamaCpp(str(gguf), "", extra_buffers), RadixlmChild(str(gguf))]
    systems[0].name = "llama.cpp"
    systems[1].child.stdout.readline()  # "ready": loaded and warmed up
    times = {(s.name, w): [] for s in systems for w in WORKLOADS}
    rss = {s.name: 0 for s in systems}
    pss = {s.name: 0 for s in systems}
    try:
        for round_ in range(rounds + 1):  # round 0 warms both up, unmeasured
            for name, (count, length, new, _) in WORKLOADS.items():
                batch = prompts(round_ * 10 + len(name), count, length, vocab)
                for system in systems:
                    seconds = system.generate(batch, new)
                    resident, proportional = tree_memory(system.child.pid)
                    rss[system.name] = max(rss[system.name], resident)
                    pss[system.name] = max(pss[system.name], proportional)
                    if round_:
                        times[(system.name, name)].append(seconds)
    finally:
        for system in systems:
            system.close()
    return {"seconds": {f"{s} | {w}": statistics.median(v) for (s, w), v in times.items()},
            "rss_mib": {s: r / 2**20 for s, r in rss.items()},
            "pss_mib": {s: r / 2**20 for s, r in pss.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["gemma3", "smollm2"])
    parser.add_argument("--worker")
    parser.add_argument("--llama-extra-buffers", action="store_true",
                        help="let llama.cpp repack weights (use_extra_bufts); llama-cpp-python "
                             "0.3.36 crashes with them on AMX CPUs (llama_cpp_worker.py)")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gemma3_file import gemma3_gguf

    from radixlm.models.default_model import radixlm_cache_dir

    files = {"gemma3": lambda: gemma3_gguf(),
             "smollm2": lambda: smollm2_q4_k_m(radixlm_cache_dir() / "bench")}
    print(f"cpu flags: {cpu_flags()}; {psutil.cpu_count()} cores; llama.cpp extra buffers "
          f"{'on' if args.llama_extra_buffers else 'off'}; OpenMP wait: {openmp_setting()}")
    for model in args.models:
        result = bench(files[model](), args.rounds, args.llama_extra_buffers)
        print(f"\n{model}:")
        for workload, (*_, tokens) in WORKLOADS.items():
            ours = result["seconds"][f"radixlm | {workload}"]
            theirs = result["seconds"][f"llama.cpp | {workload}"]
            print(f"  {workload:15s} radixlm {tokens / ours:8.1f} tok/s  llama.cpp "
                  f"{tokens / theirs:8.1f} tok/s  ratio {theirs / ours:5.2f}x")
        for kind in ("rss", "pss"):
            mem = result[f"{kind}_mib"]
            print(f"  resident memory ({kind.upper()}) radixlm {mem['radixlm']:.0f} MiB, "
                  f"llama.cpp {mem['llama.cpp']:.0f} MiB, "
                  f"ratio {mem['radixlm'] / mem['llama.cpp']:.2f}x")


if __name__ == "__main__":
    main()
