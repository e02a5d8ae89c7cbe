"""Tests of radixlm/runtime/disaggregation/decode_handoff.py's ``AdapterRoom``: which handed-off
requests on LoRA adapters a decode server may take KV for in a step."""

from __future__ import annotations

from types import SimpleNamespace

from radixlm.runtime.disaggregation.decode_handoff import AdapterRoom


def on(name: str | None):
    return SimpleNamespace(lora_name=name)


def test_present_adapters_and_the_base_model_always_go():
    room = AdapterRoom({"a", "b"}, limit=2)
    assert all(room.admits(on(name)) for name in ["a", None, "b", "a"])
    assert room.present == {"a", "b"}


def test_new_adapters_take_free_places_up_to_the_limit():
    room = AdapterRoom({"a"}, limit=3)
    assert [room.admits(on(n)) for n in ["b", "c", "d", "b", "c"]] == [
        True, True, False, True, True]
    assert room.present == {"a", "b", "c"}


def test_once_an_adapter_finds_no_place_no_later_new_one_goes_before_it():
    room = AdapterRoom({"a", "b"}, limit=2)
    assert not room.admits(on("c"))
    room.present.discard("b")  # (a place frees within the step: still none jumps the queue)
    assert not room.admits(on("d"))
    assert room.admits(on("a")) and room.admits(on(None))
    later = AdapterRoom({"a"}, limit=2)  # the next step: the oldest waiter comes first
    assert later.admits(on("c")) and not later.admits(on("d"))
