"""llama.cpp's side of ``bench_generation.py``, in a process without torch (whose OpenMP
settings slow llama.cpp's threads down): lines of JSON requests in, elapsed seconds out.

    python benchmarks/llama_cpp_worker.py model.gguf   # then {"batch": [[ids]], "new_tokens": n}
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(gguf: str) -> None:
    """Runs each request sequence by sequence (llama-cpp-python decodes one at a time),
    greedy, and prints the seconds it took."""
    from llama_cpp import Llama

    llm = Llama(gguf, n_ctx=2048, n_batch=512, n_threads=os.cpu_count(), verbose=False)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        for prompt in request["batch"]:
            llm.reset()
            llm.eval(prompt)
            for _ in range(request["new_tokens"] - 1):
                llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
        print(time.perf_counter() - start, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
