"""The store of finished responses: its bounds (count, characters, idle time), LRU order and
deletion, against a reference model of what it must hold; conversations rebuilt from
chains of responses that each hold only their own turn."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.server.response_store import ResponseStore, StoredResponse


class FakeClock:
    """A clock the test moves by hand (no sleeping)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(text: str, previous: str | None = None) -> StoredResponse:
    return StoredResponse({"id": "r", "output": [{"role": "assistant", "content": text}]},
                          [{"role": "user", "content": text}], previous)


def test_a_chain_rebuilds_its_conversation_and_costs_linear_characters():
    store = ResponseStore()
    previous = None
    for turn in range(30):
        store.put(f"r{turn}", stored(f"turn {turn:02}", previous))
        previous = f"r{turn}"
    # Each turn holds only its own input and output: 30 entries of one size (a store
    # holding whole conversations would hold 1 + 2 + ... + 30 turns' worth).
    assert store.chars == 30 * stored("turn 00", "r0").chars
    conversation = store.conversation("r29")
    assert conversation == [item for turn in range(30) for item in (
        {"role": "user", "content": f"turn {turn:02}"},
        {"role": "assistant", "content": f"turn {turn:02}"})]
    assert store.conversation("r0") == conversation[:2]


def test_a_chain_with_a_dropped_link_cannot_be_continued():
    store = ResponseStore()
    store.put("a", stored("1"))
    store.put("b", stored("2", "a"))
    store.put("c", stored("3", "b"))
    store.delete("b")
    assert store.conversation("c") is None and store.conversation("a") is not None
    assert store.conversation("unknown") is None


def test_rebuilding_a_conversation_uses_every_link_so_the_chain_ages_as_one():
    store = ResponseStore(max_responses=3)
    store.put("a", stored("1"))
    store.put("b", stored("2", "a"))
    store.put("other", stored("x"))
    assert store.conversation("b") is not None  # a and b are now more recent than other
    store.put("c", stored("3", "b"))
    assert "other" not in store and store.conversation("c") is not None


def test_the_least_recently_used_response_goes_first_when_the_count_is_reached():
    store = ResponseStore(max_responses=2)
    store.put("a", stored("1"))
    store.put("b", stored("2"))
    assert store.get("a") is not None  # a is now more recent than b
    store.put("c", stored("3"))
    assert "b" not in store and "a" in store and "c" in store and len(store) == 2


def test_responses_are_dropped_until_the_new_one_fits_the_characters():
    size = stored("x" * 100).chars
    store = ResponseStore(max_chars=2 * size + 10)
    store.put("a", stored("x" * 100))
    store.put("b", stored("y" * 100))
    store.put("c", stored("z" * 100))
    assert "a" not in store and store.chars == 2 * size <= store.max_chars


def test_a_response_larger_than_the_bound_is_not_stored_and_drops_nothing():
    store = ResponseStore(max_chars=200)
    store.put("a", stored("small"))
    assert not store.put("big", stored("x" * 500))
    assert "big" not in store and "a" in store


def test_an_idle_response_expires_and_a_read_keeps_one_alive():
    clock = FakeClock()
    store = ResponseStore(idle_seconds=10, clock=clock)
    store.put("a", stored("1"))
    store.put("b", stored("2"))
    clock.now = 8
    assert store.get("a") is not None
    clock.now = 12  # b idle for 12 s, a for 4 s
    assert store.get("b") is None and store.get("a") is not None
    clock.now = 30
    assert len(store) == 0 and store.chars == 0


def test_delete_removes_a_response_once():
    store = ResponseStore()
    store.put("a", stored("1"))
    assert store.delete("a") and not store.delete("a") and store.get("a") is None


@pytest.mark.parametrize("field, value", [("max_responses", 0), ("max_chars", 0),
                                          ("idle_seconds", 0)])
def test_bounds_must_be_positive(field, value):
    with pytest.raises(ValueError, match=field):
        ResponseStore(**{field: value})


operations = st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "wait"]),
                                st.sampled_from("abcde"), st.integers(0, 60)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_the_store_matches_a_reference_lru_model(ops):
    clock = FakeClock()
    store = ResponseStore(max_responses=3, max_chars=400, idle_seconds=50, clock=clock)
    model: OrderedDict[str, tuple[int, float]] = OrderedDict()  # id -> (chars, last used)

    def expire() -> None:
        for key in [k for k, (_, used) in model.items() if used <= clock.now - 50]:
            del model[key]

    for op, key, amount in ops:
        expire()
        if op == "wait":
            clock.now += amount
            continue
        if op == "put":
            entry = stored("x" * amount * 3)
            if entry.chars <= 400:
                model.pop(key, None)
                while model and (len(model) >= 3 or sum(c for c, _ in model.values())
                                 + entry.chars > 400):
                    model.popitem(last=False)
                model[key] = (entry.chars, clock.now)
            assert store.put(key, entry) == (entry.chars <= 400)
        elif op == "get":
            assert (store.get(key) is not None) == (key in model)
            if key in model:
                model[key] = (model[key][0], clock.now)
                model.move_to_end(key)
        else:
            assert store.delete(key) == (model.pop(key, None) is not None)
        assert list(store._entries) == list(model)
        assert store.chars == sum(c for c, _ in model.values()) <= 400
