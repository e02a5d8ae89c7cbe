"""The workloads of ``bench_speculative.py``: chats built here, deterministic, from text the
standard library carries (module docstrings, function sources) and from templates.

- ``quote_doc``: quote or summarise a given passage;
- ``edit_code``: rename a parameter in a given function, reply with the code;
- ``extract_json``: fill a JSON object from a given support note;
- ``tool_chat``: a multi-turn chat whose tool message holds a JSON list to restate as a table;
- ``open_chat``: write a short story (little to copy); ``regenerate``: the same prompts.
"""

from __future__ import annotations

import json

DOC_MODULES = ("pdb", "re", "socketserver", "statistics", "json", "argparse", "csv", "cmd",
               "hashlib", "timeit", "unittest", "copy", "uuid", "pydoc", "heapq", "inspect")
CODE_MODULES = ("textwrap", "json.decoder", "difflib", "glob", "shutil", "ast", "dataclasses",
                "statistics", "ipaddress", "urllib.parse", "email.utils")
STORY_TOPICS = ("a lighthouse keeper who finds a message in a bottle", "a robot learning to bake",
                "a dragon afraid of heights", "two rival gardeners", "a lost umbrella",
                "a city where it never stops snowing", "a cat who runs a library",
                "the last train of the night", "a violin that plays by itself",
                "a child who can talk to clouds", "an astronaut's first day on Mars",
                "a forgotten birthday", "a detective who is a pigeon", "a map drawn in tea",
                "a chess game that lasts a century", "a bridge that sings")


def passage(module: str, chars: int = 1100) -> str:
    """The start of ``module``'s docstring, cut at a paragraph (or line) end."""
    import importlib
    import inspect

    text = inspect.getdoc(importlib.import_module(module)) or ""
    if len(text) <= chars:
        return text
    cut = text.rfind("\n\n", 0, chars)
    return text[: cut if cut > chars // 2 else text.rfind("\n", 0, chars)]


def code_functions(count: int) -> list[tuple[str, str]]:
    """``count`` stdlib functions of 30-60 lines, with their first parameter's name."""
    import importlib
    import inspect

    found = []
    for name in CODE_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            if not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            source = inspect.getsource(obj)
            params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
            if 30 <= source.count("\n") <= 60 and params and len(params[0]) > 1:
                found.append((source, params[0]))
    return found[:count]


def support_note(i: int) -> str:
    import random

    rng = random.Random(i)
    first = rng.choice(["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana"])
    last = rng.choice(["Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Novak", "Haddad"])
    city = rng.choice(["Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lima", "Perth"])
    job = rng.choice(["nurse", "carpenter", "teacher", "pilot", "chemist", "librarian"])
    item = rng.choice(["desk lamps", "hiking boots", "coffee grinders", "wool scarves"])
    return (f"Support note {i + 1}, filed 2026-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}. "
            f"{first} {last}, a {rng.randint(21, 79)}-year-old {job} from {city}, called about "
            f"order #{rng.randint(100000, 999999)}. They bought {rng.randint(2, 9)} {item} at "
            f"{rng.randint(10, 99)}.{rng.randint(10, 99)} EUR each; two arrived damaged and "
            f"they would like a replacement rather than a refund. They can be reached at "
            f"{first.lower()}.{last.lower()}@example.org or +351 {rng.randint(200, 999)} "
            f"{rng.randint(100, 999)} {rng.randint(100, 999)}, preferably in the morning.")


def tool_chat(i: int) -> list[dict[str, str]]:
    import random

    rng = random.Random(1000 + i)
    warehouse = ["Rotterdam", "Leeds", "Valencia", "Gdansk", "Turin", "Ghent", "Lyon",
                 "Bergen"][i % 8] + f" {i // 8 + 1}"
    goods = ["pallet jack", "shrink wrap", "label printer", "safety gloves", "box cutter",
             "tape gun", "hand truck", "barcode scanner", "step ladder", "bubble wrap"]
    rows = [{"sku": f"SKU-{rng.randint(1000, 9999)}", "name": name,
             "quantity": rng.randint(0, 500), "unit_price": round(rng.uniform(2, 400), 2)}
            for name in rng.sample(goods, 7)]
    return [
        {"role": "system", "content": "You are a warehouse assistant with access to tools."},
        {"role": "user", "content": f"What do we have in stock at the {warehouse} warehouse?"},
        {"role": "assistant", "content": f'Calling inventory_lookup(warehouse="{warehouse}").'},
        {"role": "tool", "content": json.dumps(rows)},
        {"role": "user", "content": "Please restate that result as a markdown table with "
                                    "columns SKU, name, quantity and unit price."},
    ]


def workloads(count: int) -> dict[str, list[list[dict[str, str]]]]:
    """Each workload's ``count`` chats (lists of messages)."""
    docs = [passage(m) for m in DOC_MODULES[:count]]
    quote = [[{"role": "user", "content": (
        ("Quote the following passage word for word.\n\n" if i % 2 == 0 else
         "Summarise the following passage, quoting its key sentences.\n\n") + doc)}]
        for i, doc in enumerate(docs)]
    edit = [[{"role": "user", "content": (
        f"Rename the parameter `{param}` to `input_{param}` in this code and reply with the "
        f"whole edited code.\n\n```python\n{source}```")}]
        for source, param in code_functions(count)]
    keys = ("name, age, city, occupation, email, phone, order_id, item, quantity, "
            "unit_price")
    extract = [[{"role": "user", "content": (
        f"Extract these fields from the note below as a JSON object with the keys {keys}."
        f"\n\n{support_note(i)}")}] for i in range(count)]
    stories = [[{"role": "user", "content": f"Write a short story about {topic}."}]
               for topic in STORY_TOPICS[:count]]
    return {"quote_doc": quote, "edit_code": edit, "extract_json": extract,
            "tool_chat": [tool_chat(i) for i in range(count)], "open_chat": stories,
            "regenerate": stories}
