"""Device-true sampling: every path of the sampler (greedy, temperature, top-k / top-p / min-p,
penalties, logit bias, the min_new_tokens ban, seeds, grammar masks) and of the logprobs runs
with logits on the ``meta`` device, where any CPU tensor meeting a meta tensor raises, under a
``DeviceGuard`` that also catches what ``meta`` lets through: CPU scalars, tensors made off the
device, blocking host-to-device copies and reads back to the host (both wait for a GPU)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from radixlm.host_to_device import to_device
from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.sampling.logprobs import logprob_tensors
from radixlm.runtime.sampling.sampler import Sampler
from radixlm.runtime.sampling.sampling_params import SamplingParams

META = torch.device("meta")
EOS = 0
READ_BACK = {"tolist", "item", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__",
             "__index__"}
TRANSFERS = {"to", "copy_"}


class DeviceGuard(TorchFunctionMode):
    """Fails when tensors on two devices meet in one op, when a tensor is made on a device
    other than ``device`` (a host tensor made from host data may exist only to be copied to
    ``device`` without blocking), when ``torch.tensor`` builds on the device from host data
    (a blocking copy), and when a ``device`` tensor is read back on the host.

    Host tensors made before the guard (the grammar's bitmask buffer) may be worked on."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.staged: dict[int, weakref.ref] = {}  # host tensors awaiting their copy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in inputs}
        copy_to_device = name in TRANSFERS and kwargs.get("non_blocking") is True
        for tensor in inputs:
            ref = self.staged.get(id(tensor))
            if ref is not None and ref() is tensor and not copy_to_device:
                raise AssertionError(f"{name}: a host tensor is used before its copy to "
                                     f"{self.device}")
        if self.device in devices and name in READ_BACK:
            raise AssertionError(f"{name} reads a {self.device} tensor back on the host")
        if func is torch.tensor and torch.device(kwargs.get("device") or "cpu") == self.device:
            raise AssertionError("torch.tensor(data, device=...) copies host data blocking")
        result = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if name in TRANSFERS:
            if self.device in devices and any(t.device != self.device for t in outputs):
                raise AssertionError(f"{name} reads a {self.device} tensor back on the host")
            if any(t.device == self.device for t in outputs) and devices - {self.device} and (
                kwargs.get("non_blocking") is not True
            ):
                raise AssertionError(f"{name} copies to {self.device} blocking")
            return result
        if len(devices) > 1:
            raise AssertionError(f"{name} mixes tensors on {sorted(map(str, devices))}")
        for tensor in outputs:
            if tensor.device == self.device:
                continue
            if inputs:
                if self.device in devices:
                    raise AssertionError(f"{name} made a tensor on {tensor.device}")
            elif "device" in kwargs:
                raise AssertionError(f"{name} made a tensor on {tensor.device}")
            else:
                self.staged[id(tensor)] = weakref.ref(tensor)
        return result


def req(output_ids=(), grammar=None, **params):
    from types import SimpleNamespace

    return SimpleNamespace(sampling=SamplingParams.from_dict(params), input_ids=[5, 6, 7, 5],
                           output_ids=list(output_ids), grammar=grammar)


def matcher(backend, text: str = ""):
    """A matcher of ``(cat|dog) [0-9]{1,2}`` that has accepted ``text``."""
    made = backend.new_matcher(backend.compile(GrammarKey("regex", "(cat|dog) [0-9]{1,2}"))
                               .result())
    for token in backend.tokenizer.encode(text):
        assert made.accept_token(token)
    return made


def every_path(backend) -> list:
    """A batch with each sampling setting, alone and combined, greedy and sampled."""
    return [
        req(temperature=0.0),
        req(temperature=0.7),
        req(temperature=0.9, top_k=5),
        req(temperature=1.1, top_p=0.8),
        req(temperature=0.6, min_p=0.1),
        req(temperature=0.8, sampling_seed=42, top_k=10, top_p=0.9, min_p=0.05),
        req([5, 8, 8], temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        req([9], temperature=0.7, repetition_penalty=1.4),
        req(temperature=0.0, logit_bias={"3": 4.0, "12": -2.0}),
        req([1], temperature=0.5, min_new_tokens=4, stop_token_ids=[9]),
        req(temperature=0.0, grammar=matcher(backend)),
        # complete but extendable: the min_new_tokens ban yields to the grammar
        req(temperature=0.9, sampling_seed=7, grammar=matcher(backend, "cat 1"),
            min_new_tokens=3),
    ]


def test_every_sampling_path_stays_on_the_logits_device(grammar_backend):
    vocab = grammar_backend.vocab_size
    reqs = every_path(grammar_backend)
    grammar_backend.bitmask(len(reqs))  # the host buffer xgrammar fills, made once up front
    sampler = Sampler(vocab, {EOS}, seed=0, grammar_backend=grammar_backend)
    assert reqs[-1].grammar.is_completed()
    with DeviceGuard(META):
        batch = sampler.new_batch(META)
        batch.add(reqs[:5])
        batch.add(reqs[5:])  # joins: every feature's columns grow
        for _ in range(3):
            logits = torch.randn(len(batch), vocab + 3, device=META)  # (B, V + padding)
            tokens = sampler.sample(logits, batch)
            assert tokens.device == META and tokens.shape == (len(batch),)
            assert tokens.dtype == torch.int64
            batch.record_sampled(tokens)
            batch.record_appended(batch.reqs[-1], [3, 4])  # jump-forward tokens
            for r in batch.reqs:
                r.output_ids.append(1)
        view = batch.select(batch.reqs[6:])
        assert sampler.sample(torch.randn(len(view), vocab, device=META), view).device == META
        view.record_sampled(torch.zeros(len(view), dtype=torch.int64, device=META))
        constrained = batch.select(batch.reqs[-2:])  # masked rows 0 .. N - 1: no index
        assert sampler.sample(torch.randn(2, vocab, device=META), constrained).device == META
        batch.remove([reqs[0], reqs[6], reqs[10]])
        assert sampler.sample(torch.randn(len(batch), vocab, device=META), batch).device == META
        chosen, values, ids = logprob_tensors(
            torch.randn(4, vocab, device=META), torch.zeros(4, dtype=torch.int64, device=META),
            top_k=3)
        assert {chosen.device, values.device, ids.device} == {META}
        assert values.shape == ids.shape == (4, 3)


def test_a_greedy_only_batch_is_one_argmax():
    """No tensor is built for a greedy batch: sampling slices off padding and takes the
    argmax, and nothing else."""
    sampler = Sampler(8, {EOS}, seed=0)
    batch = sampler.new_batch(META)
    batch.add([req(temperature=0.0) for _ in range(4)])
    logits = torch.randn(4, 10, device=META)
    with CallRecorder() as calls:
        tokens = sampler.sample(logits, batch)
        batch.record_sampled(tokens)
    assert [c for c in calls if not c.startswith("__get__")] == ["__getitem__", "argmax"]


class CallRecorder(TorchFunctionMode, list):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [[0, 1, 2], [1, 3], [2]])
def test_the_pure_torch_mask_equals_the_cpu_mask(grammar_backend, rows):
    """The bit unpacking ``meta`` (and any device without xgrammar's kernel) runs, checked
    for values on the CPU against the CPU path."""
    from radixlm.runtime.grammar.xgrammar_backend import _apply_unpacked_bits

    vocab = grammar_backend.vocab_size
    matchers = [matcher(grammar_backend, text) for text in ("", "cat", "dog 4", "do")]
    bitmask = grammar_backend.bitmask(len(matchers))
    for row in rows:
        matchers[row].fill_bitmask(bitmask, row)
    logits = torch.randn(len(matchers), vocab + 2)
    expected = logits.clone()
    grammar_backend.apply_bitmask(expected, bitmask, rows)
    got = logits.clone()
    _apply_unpacked_bits(got, bitmask, rows, vocab)
    assert torch.equal(got, expected)
    assert torch.isinf(got[rows]).any() and torch.equal(got[:, vocab:], logits[:, vocab:])


# The guard itself can fail ------------------------------------------------------------------


@pytest.mark.parametrize(("name", "bad"), [
    ("a CPU scalar meeting the device", lambda x: x * torch.tensor(2.0)),
    ("a tensor made on the CPU", lambda x: x + torch.arange(x.shape[-1], device="cpu")),
    ("a host tensor used before its copy", lambda x: x + torch.tensor([1.0])),
    ("a blocking copy to the device", lambda x: x + torch.tensor([1.0]).to(META)),
    ("torch.tensor built on the device", lambda x: x + torch.tensor([1.0], device=META)),
    ("a read back to the host", lambda x: x.cpu()),
])
def test_the_guard_trips_on_tensors_off_the_device(name, bad):
    x = torch.randn(3, 1, device=META)
    with pytest.raises(AssertionError), DeviceGuard(META):
        bad(x)


def test_the_guard_lets_a_non_blocking_copy_of_host_data_through():
    x = torch.randn(3, 2, device=META)
    with DeviceGuard(META):
        assert (x + to_device([1.0, 2.0], torch.float32, META)).device == META


def test_the_guard_catches_a_sampler_that_builds_its_ranks_on_the_cpu(monkeypatch):
    """The old sampler's ``torch.arange(V)`` (on the CPU) in the top-k filter, put back."""
    real_arange = torch.arange

    def cpu_arange(*args, **kwargs):
        kwargs.pop("device", None)
        return real_arange(*args, **kwargs)

    sampler = Sampler(8, {EOS}, seed=0)
    batch = sampler.new_batch(META)
    batch.add([req(temperature=0.7, top_k=2)])
    monkeypatch.setattr(torch, "arange", cpu_arange)
    with pytest.raises(AssertionError, match="host tensor"), DeviceGuard(META):
        sampler.sample(torch.randn(1, 8, device=META), batch)
