"""llama.cpp's side of ``bench_generation.py``, in a process without torch (whose OpenMP
settings slow llama.cpp's threads down): lines of JSON requests in, elapsed seconds out.

    python benchmarks/llama_cpp_worker.py model.gguf [--no-extra-buffers]
    # then lines of {"batch": [[ids]], "new_tokens": n}

``--no-extra-buffers`` loads the weights without ggml's repacked layouts
(``use_extra_bufts``): llama-cpp-python 0.3.36 crashes (SIGSEGV at the first evaluation) on a
Q8_0 model with them on an AMX CPU; on F16 they made no difference there (55 tok/s either way).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(gguf: str, extra_buffers: bool) -> None:
    """Runs each request sequence by sequence (llama-cpp-python decodes one at a time),
    greedy, and prints the seconds it took."""
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    if not extra_buffers:  # Llama() offers no argument for it; it reads these defaults
        defaults = bindings.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_buffers

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
    main(sys.argv[1], extra_buffers="--no-extra-buffers" not in sys.argv[2:])
