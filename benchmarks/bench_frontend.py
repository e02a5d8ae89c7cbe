"""Frontend programs on the default model, with the radix cache on vs off.

(a) 5-shot multiple choice in the style of MMLU: a shared ~500-token prefix of five worked
    questions, then a new question answered with ``select`` over " A" .. " D", over N
    questions in one ``run_batch``.
(b) Tree of thought: a shared instruction and a question, then ``fork(3)`` plans, each
    ``fork(2)`` steps (nested forks), then a conclusion written from the gathered plans and
    steps, over a few questions in one ``run_batch``.

Each workload runs on two engines with the same options but ``disable_radix_cache``,
interleaved repetition by repetition (so a busy neighbour slows both alike), each repetition
starting from an empty cache. Reported: programs per second for each, their ratio, and the
fraction of prompt tokens the cache served (from the scheduler's counters, so it counts
every request a program makes: select's scoring, fork's prefix hints, the gens). Both runs
make the same requests: with the cache off, the frontend's prefix hints are pure overhead,
as they are in SGLang's own ablation. Greedy decoding throughout, so both engines should
give the same answers; the agreement is printed as a check.

    python benchmarks/bench_frontend.py [--questions 24] [--tot-questions 4] [--repeats 3]
    python benchmarks/bench_frontend.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import radixlm as sgl  # noqa: E402

FEW_SHOT = [
    ("Which process do green plants use to turn light, water and carbon dioxide into sugar "
     "and oxygen? The process takes place mostly in the leaves, inside small structures "
     "that hold a green pigment. Animals depend on the oxygen that this process releases "
     "into the air.",
     ["Respiration", "Photosynthesis", "Fermentation", "Transpiration"], "B"),
    ("A cyclist rides at a steady 15 kilometres per hour for 3 hours along a flat road, "
     "then stops for lunch at a village cafe. The wind is calm and the cyclist does not "
     "rest on the way. How many kilometres has the cyclist covered before the stop?",
     ["18", "30", "45", "60"], "C"),
    ("In the made-up kingdom of Varnia, the council meets in the capital every spring. The "
     "capital sits on the river Olm, between the northern hills and the southern marshes, "
     "and its old stone bridge is the only crossing for many miles. "
     "Which of these best describes where the council meets?",
     ["In the northern hills", "In the southern marshes", "On the coast",
      "In a city on the river Olm"], "D"),
    ("A chemist mixes 200 millilitres of water with 50 millilitres of juice concentrate. "
     "The drink is stirred well and nothing else is added to the jug. What fraction of "
     "the final drink is juice concentrate?",
     ["One fifth", "One quarter", "One half", "Four fifths"], "A"),
    ("Which of these statements about the Moon is correct? Consider its light, its orbit "
     "and its surface as seen from the Earth on a clear night, through a small telescope "
     "or with the naked eye.",
     ["The Moon always shows the same face to the Earth",
      "The Moon makes its own light", "The Moon orbits the Sun but not the Earth",
      "The Moon has no craters"], "A"),
]
LETTERS = "ABCD"
INSTRUCTION = ("The following are multiple choice questions about general knowledge, "
               "arithmetic and reading. Read each question carefully, think about every "
               "option, and answer with the letter of the single best option. Some questions "
               "describe made-up places; answer them from the text alone.\n\n")


def format_question(question: str, choices: list[str]) -> str:
    lines = [f"Question: {question}"]
    lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices)]
    return "\n".join(lines) + "\nAnswer:"


FEW_SHOT_PREFIX = INSTRUCTION + "".join(
    format_question(q, c) + f" {answer}\n\n" for q, c, answer in FEW_SHOT)


def made_up_questions(count: int, rng: random.Random) -> list[dict[str, Any]]:
    """Arithmetic word questions with three wrong options near the right one."""
    templates: list[Callable[[int, int], tuple[str, int]]] = [
        lambda a, b: (f"A shop sells pencils at {a} cents each. How many cents do {b} "
                      f"pencils cost?", a * b),
        lambda a, b: (f"A rectangle is {a} metres wide and {b} metres long. What is its "
                      f"area in square metres?", a * b),
        lambda a, b: (f"A farmer has {a + b} sheep and sells {b} of them. How many sheep "
                      f"are left?", a),
        lambda a, b: (f"A bus carries {a} people and {b} more get on at the next stop. How "
                      f"many people are on the bus now?", a + b),
    ]
    questions = []
    for index in range(count):
        a, b = rng.randint(3, 12), rng.randint(2, 9)
        question, answer = templates[index % len(templates)](a, b)
        options = {answer}
        while len(options) < 4:
            options.add(max(answer + rng.choice([-b, -2, -1, 1, 2, b, a]), 0))
        choices = [str(option) for option in sorted(options, key=lambda _: rng.random())]
        questions.append({"question": question, "choices": choices,
                          "key": LETTERS[choices.index(str(answer))]})
    return questions


@sgl.function
def multiple_choice(s, question, choices):
    s += FEW_SHOT_PREFIX
    s += format_question(question, choices)
    s += sgl.select("answer", choices=[f" {letter}" for letter in LETTERS])


TOT_INSTRUCTION = (
    "You are a careful planner. For every problem you first write several short, different "
    "plans, then expand each plan into concrete steps, and finally compare the plans and "
    "pick the most practical one. Keep each plan and each step to one sentence. Prefer "
    "plans that are cheap, safe and quick to try, and say plainly when a plan has a "
    "serious drawback. Do not repeat the problem statement.")
TOT_QUESTIONS = [
    "How can a small town reduce traffic in its centre?",
    "How should a student prepare for an exam in one week?",
    "How can a family spend less money on food?",
    "How can a library attract more young readers?",
    "How can an office use less paper?",
    "How can a runner train for a first marathon?",
    "How can a school garden grow more vegetables?",
    "How can a team run shorter meetings?",
]


@sgl.function
def tree_of_thought(s, question):
    s += sgl.system(TOT_INSTRUCTION)
    s += sgl.user(question)
    s += sgl.assistant_begin()
    s += "Here are three plans.\n"
    plans = s.fork(3)
    plans += lambda i: f"Plan {i + 1}:" + sgl.gen("plan", max_tokens=16, stop="\n") + "\n"
    step_groups = [plan.fork(2) for plan in plans]
    for steps in step_groups:
        steps += lambda j: f"Step {j + 1}:" + sgl.gen("step", max_tokens=16, stop="\n")
    for steps in step_groups:
        steps.join()
    plans.join()
    for index, (plan, steps) in enumerate(zip(s["plan"], s["step"])):
        s += f"Plan {index + 1}:{plan} Steps:{' '.join(steps)}\n"
    s += "The most practical plan is Plan" + sgl.gen("best", max_tokens=16, stop="\n")
    s += sgl.assistant_end()


def run_once(engine: sgl.Engine, program: sgl.Program,
             items: list[dict[str, Any]]) -> tuple[float, list[sgl.ProgramState], float]:
    """(seconds, states, cached fraction of prompt tokens) for one run_batch on a fresh
    cache."""
    if not engine.flush_cache():
        raise RuntimeError("the engine did not flush its cache: requests are still running")
    before = engine.get_server_info()["stats"]
    start = time.perf_counter()
    states = program.run_batch(items, backend=engine, temperature=0)
    seconds = time.perf_counter() - start
    after = engine.get_server_info()["stats"]
    for state in states:
        if state.error() is not None:
            raise state.error()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return seconds, states, cached / max(prompt, 1)


def compare(name: str, engines: dict[str, sgl.Engine], program: sgl.Program,
            items: list[dict[str, Any]], answer: Callable[[sgl.ProgramState], Any],
            repeats: int) -> dict[str, Any]:
    for engine in engines.values():  # warm-up
        run_once(engine, program, items[:2])
    seconds: dict[str, list[float]] = {mode: [] for mode in engines}
    fractions: dict[str, list[float]] = {mode: [] for mode in engines}
    answers: dict[str, list[Any]] = {}
    for _ in range(repeats):
        for mode, engine in engines.items():
            elapsed, states, fraction = run_once(engine, program, items)
            seconds[mode].append(elapsed)
            fractions[mode].append(fraction)
            answers[mode] = [answer(state) for state in states]
    rates = {mode: len(items) / statistics.median(runs) for mode, runs in seconds.items()}
    agree = sum(a == b for a, b in zip(answers["on"], answers["off"]))
    return {"name": name, "items": len(items), "on": rates["on"], "off": rates["off"],
            "cached": statistics.median(fractions["on"]), "agree": agree,
            "answers": answers["on"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=24,
                        help="multiple-choice questions per run_batch")
    parser.add_argument("--tot-questions", type=int, default=4,
                        help="tree-of-thought questions per run_batch (at most 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2,
                        help="CPU threads per engine (0: the engine's adaptive default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["select", "tot"], default=None)
    parser.add_argument("--quick", action="store_true",
                        help="8 questions, 2 tree-of-thought questions, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.questions, args.tot_questions, args.repeats = 8, 2, 1
    if not 1 <= args.tot_questions <= len(TOT_QUESTIONS):
        parser.error(f"--tot-questions must be in [1, {len(TOT_QUESTIONS)}]")
    if args.questions < 2 or args.repeats < 1:
        parser.error("--questions must be at least 2 and --repeats at least 1")
    options = {"num_threads": args.num_threads or None, "max_total_tokens": 65536}
    engines = {"on": sgl.Engine(**options),
               "off": sgl.Engine(**options, disable_radix_cache=True)}
    try:
        rows = []
        if args.only in (None, "select"):
            questions = made_up_questions(args.questions, random.Random(args.seed))
            items = [{"question": q["question"], "choices": q["choices"]} for q in questions]
            prefix_tokens = len(engines["on"].tokenizer.encode(FEW_SHOT_PREFIX))
            rows.append(compare(f"5-shot select ({prefix_tokens}-token prefix)", engines,
                                multiple_choice, items, lambda s: s["answer"].strip(),
                                args.repeats))
            correct = sum(a == q["key"] for a, q in zip(rows[-1]["answers"], questions))
        if args.only in (None, "tot"):
            items = [{"question": q} for q in TOT_QUESTIONS[: args.tot_questions]]
            rows.append(compare("tree of thought (fork 3 x fork 2)", engines,
                                tree_of_thought, items, lambda s: s["best"], args.repeats))
    finally:
        for engine in engines.values():
            engine.shutdown()
    print(f"\nSmolLM2-135M-Instruct, num_threads={args.num_threads or 'adaptive'}, "
          f"temperature 0, median of {args.repeats} interleaved repeats")
    print(f"{'workload':<40} {'programs':>8} {'cache on/s':>11} {'cache off/s':>12} "
          f"{'on/off':>7} {'cached':>7} {'same answers':>13}")
    for row in rows:
        print(f"{row['name']:<40} {row['items']:>8} {row['on']:>11.2f} {row['off']:>12.2f} "
              f"{row['on'] / row['off']:>6.2f}x {row['cached']:>7.0%} "
              f"{row['agree']:>6}/{row['items']:<6}")
    if args.only in (None, "select"):
        print(f"multiple-choice accuracy (cache on): {correct}/{len(questions)} "
              f"(chance is 1/4; the model is small)")


if __name__ == "__main__":
    main()
