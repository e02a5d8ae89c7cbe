"""The scheduler's own cost per step: everything but the model, at 1, 64 and 256 running requests.

The real Scheduler is built in this process over a tiny model (written to a temporary
directory), as the scheduler process builds it; then the model's forward pass and LM head
are replaced by stand-ins that return at once (zero hidden states, logits naming one
ordinary token), so admission, KV allocation, batch building, sampling, stop checks and
prefix caching all run for real and the time per step is theirs. The scheduler process also
packs each step's new tokens into one message for the detokenizer;
that is timed too (the "+ report" column: ``report_message`` for the step's requests and
msgpack encoding, not the socket sends).

For each batch size: the prefill steps that admit the batch (time per admitted request),
then ``--steps`` decode steps with every request running: time per step, per request-step,
the share of it spent inside the stand-ins and the share spent in the sampler (over the
stand-in's logits, mostly one kernel, device work on a GPU). "runtime" is the step without
either: what the runtime's own code costs.

On a CPU the stand-in's logits live in host memory: at ``--vocab 32000`` and 256 requests
they are 32 MB per step, and making them and the sampler's argmax over them evict the
host's caches, so every later per-request touch misses and the "runtime" column swings
with the machine's memory traffic. A small vocabulary (``--vocab 1024``) measures the host's
own cost as it is beside a GPU, whose logits never touch the host's caches.

``--forward-ms`` gives the stand-in forward pass a fixed duration spent outside the GIL
(``time.sleep``), as a device's forward pass would be: what the step takes beyond it is the
runtime's own cost, measured as it would add to (or hide behind) a real forward pass.
``--overlap`` runs the plain loop, overlap scheduling (the forward pass and sampling on a
worker thread while the host prepares and processes steps), or both, side by side. Under
overlap the stand-in and sampler run beside the host's work, so "runtime" (the step less
their time) is no longer the host's cost: compare the step times.

    python benchmarks/bench_scheduler.py [--sizes 1 64 256] [--steps 200] [--vocab 32000]
                                         [--forward-ms 0 5 20] [--overlap off|on|both]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import write_tiny_model  # noqa: E402

from radixlm.runtime import messages as wire  # noqa: E402
from radixlm.runtime.sampling.sampling_params import SamplingParams  # noqa: E402
from radixlm.runtime.scheduler.scheduler import Scheduler  # noqa: E402
from radixlm.runtime.scheduler.scheduler_process import (  # noqa: E402
    build_scheduler,
    freeze_startup_objects,
    make_req,
    report_message,
    thaw_startup_objects,
)
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

PROMPT_LEN = 64


class NoOpModel:
    """Stand-ins for ``ModelRunner.forward`` and ``compute_logits`` that time themselves.

    ``forward_seconds``: how long each forward pass lasts, asleep (the GIL released).
    """

    def __init__(self, hidden_size: int, vocab_size: int, token_range: tuple[int, int]):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.token_range = token_range
        self.forward_seconds = 0.0
        self.calls = 0
        self.seconds = 0.0

    def forward(self, batch) -> torch.Tensor:
        start = time.perf_counter()
        if self.forward_seconds:
            time.sleep(self.forward_seconds)
        hidden = torch.zeros(len(batch.input_ids), self.hidden_size)  # (T, hidden)
        self.seconds += time.perf_counter() - start
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, V), every row's argmax one ordinary token (changing per call),
        so the detokenizer and stop checks see text, not a special token."""
        start = time.perf_counter()
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        low, high = self.token_range
        logits[:, low + self.calls % (high - low)] = 1.0
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return logits


class TimedSampler:
    """Wraps ``Sampler.sample`` to time it: over the stand-in's logits it is mostly one
    kernel (greedy requests: an argmax over (running, vocab)), device work on a GPU."""

    def __init__(self, sample):
        self.sample_untimed = sample
        self.seconds = 0.0

    def __call__(self, logits, batch):
        start = time.perf_counter()
        tokens = self.sample_untimed(logits, batch)
        self.seconds += time.perf_counter() - start
        return tokens


def install(scheduler: Scheduler, model: NoOpModel) -> TimedSampler:
    scheduler.runner.forward = model.forward
    scheduler.runner.compute_logits = model.compute_logits
    # The sampling step holds the LM head it was built with.
    scheduler.sampling_step.compute_logits = model.compute_logits
    timed = TimedSampler(scheduler.sampler.sample)
    scheduler.sampler.sample = timed
    return timed


def report(stepped: list) -> list[bytes]:
    """What the scheduler process sends the detokenizer after a step (without sending it)."""
    message = report_message(stepped)
    return [] if message is None else [wire.encode(message)]


def measure(scheduler: Scheduler, model: NoOpModel, batch_size: int, steps: int,
            seed: int) -> dict[str, float]:
    """Admits ``batch_size`` requests, then times ``steps`` decode steps of them all."""
    rng = random.Random(seed)
    tokenizer = scheduler.sampling_step.tokenizer
    vocab = len(tokenizer)
    sampling = SamplingParams.from_dict(
        {"max_new_tokens": steps + 2, "temperature": 0.0, "ignore_eos": True}
    )
    reqs = []
    for i in range(batch_size):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
        reqs.append(make_req(wire.GenerateReq(f"{seed}-{i}", prompt, sampling), tokenizer, {}))
    stats = scheduler.state.stats
    for req in reqs:
        scheduler.add_request(req)

    extend_before, start = stats.extend_steps, time.perf_counter()
    while scheduler.state.waiting or scheduler.state.chunked is not None:
        scheduler.step()
    admit_seconds = time.perf_counter() - start
    admit_steps = stats.extend_steps - extend_before
    assert len(scheduler.state.running) == batch_size, "the whole batch must be running"

    sampler = scheduler.sampler.sample
    decode_before, model_before = stats.decode_steps, model.seconds
    sampler_before = sampler.seconds
    report_seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        stepped = scheduler.step()
        report_start = time.perf_counter()
        report(stepped)
        report_seconds += time.perf_counter() - report_start
    scheduler.drain()  # with overlap, the last step is still in flight
    total_seconds = time.perf_counter() - start
    decode_seconds = total_seconds - report_seconds
    assert stats.decode_steps - decode_before == steps, "every timed step must be a decode"
    assert all(len(r.output_ids) == steps + 1 for r in reqs)
    stand_in = model.seconds - model_before - model.forward_seconds * steps
    sampling = sampler.seconds - sampler_before

    while not all(r.finished for r in reqs):
        scheduler.step()
    scheduler.memory.flush()
    return {
        "admit_steps": admit_steps,
        "admit_us_per_req": admit_seconds / batch_size * 1e6,
        "decode_us_per_step": decode_seconds / steps * 1e6,
        "decode_us_per_req_step": decode_seconds / steps / batch_size * 1e6,
        "with_report_us_per_step": total_seconds / steps * 1e6,
        "stand_in_share": stand_in / decode_seconds,
        "sampler_share": sampling / decode_seconds,
        "beyond_forward_us_per_step": (decode_seconds / steps - model.forward_seconds) * 1e6,
        "runtime_us_per_step": (decode_seconds - model.seconds + model_before - sampling)
        / steps * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=32000,
                        help="the stand-in LM head's vocabulary (sampling cost grows with it)")
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[0.0],
                        help="durations of the stand-in forward pass (asleep) to measure with")
    parser.add_argument("--overlap", choices=["off", "on", "both"], default="both",
                        help="the plain loop, overlap scheduling, or both side by side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = write_tiny_model(Path(tempfile.mkdtemp()), vocab_size=args.vocab)
    largest = max(args.sizes)
    modes = {"off": ["off"], "on": ["on"], "both": ["off", "on"]}[args.overlap]
    benches = {}
    for mode in modes:
        server_args = ServerArgs(
            str(directory), dtype="float32", max_running_requests=largest,
            max_total_tokens=largest * (PROMPT_LEN + args.steps + 8),
            disable_overlap_schedule=mode == "off",
        )
        scheduler = build_scheduler(server_args, str(directory))
        config = scheduler.runner.model_config
        model = NoOpModel(config.hidden_size, config.vocab_size,
                          (3, len(scheduler.sampling_step.tokenizer)))
        install(scheduler, model)
        benches[mode] = scheduler, model
    freeze_startup_objects()  # as the scheduler process does once it is built
    for scheduler, model in benches.values():
        measure(scheduler, model, min(8, largest), min(20, args.steps), seed=0)  # warm-up
    print(f"scheduler with a stand-in model: prompts of {PROMPT_LEN} tokens, vocabulary "
          f"{config.vocab_size}, {args.steps} decode steps per size, 1 thread")
    print(f"{'forward ms':>10} {'overlap':>7} {'running':>8} {'prefill steps':>13} "
          f"{'admit us/req':>13} {'decode us/step':>15} {'beyond fwd':>11} {'runtime':>8} "
          f"{'us/req/step':>12} {'+ report us/step':>17} {'in stand-in':>12} "
          f"{'in sampler':>11}")
    for forward_ms in args.forward_ms:
        for size in args.sizes:
            for mode, (scheduler, model) in benches.items():
                model.forward_seconds = forward_ms / 1000
                row = measure(scheduler, model, size, args.steps, seed=size)
                print(f"{forward_ms:>10g} {mode:>7} {size:>8} {row['admit_steps']:>13} "
                      f"{row['admit_us_per_req']:>13.1f} {row['decode_us_per_step']:>15.1f} "
                      f"{row['beyond_forward_us_per_step']:>11.1f} "
                      f"{row['runtime_us_per_step']:>8.1f} "
                      f"{row['decode_us_per_req_step']:>12.2f} "
                      f"{row['with_report_us_per_step']:>17.1f} "
                      f"{row['stand_in_share']:>11.1%} {row['sampler_share']:>10.1%}",
                      flush=True)
    for scheduler, _ in benches.values():
        scheduler.shutdown()
    thaw_startup_objects()


if __name__ == "__main__":
    main()
