"""Every refit verified, and delta refit, end to end through `update_weights` into the refit tests' fake
engine (tests/refit/fake_engine.py: the same HTTP calls, the same gloo receiver and checks as the vLLM
worker, over a plain state dict; a fake so these run without starting vLLM). The same behaviour on the
real vLLM CPU engine: tests/refit/test_refit_vllm.py."""

from __future__ import annotations

import pytest
import torch
from refit_helpers import CorruptWire, nudged, weight_set

import refit

pytestmark = pytest.mark.slow  # each test starts the fake engine's process (torch import: seconds)
SMALL_BUCKETS = 64 << 10  # several buckets for the 350 KB tiny model


def _sums(model: torch.nn.Module, dtype=None) -> dict[str, float]:
    return {
        name: float(t.detach().to(dtype or t.dtype).double().sum()) for name, t in model.named_parameters()
    }


def _refit(engine, model, version, *, delta=False, dtype=None):
    params = refit.full_params(model, dtype=dtype)
    return refit.update_weights([engine], params, version=version, bucket_bytes=SMALL_BUCKETS, delta=delta)


def test_a_flipped_byte_fails_verification_and_a_full_refit_recovers(
    fake_engine_factory, tiny_model_dir, tmp_path, monkeypatch
):
    fake = fake_engine_factory(tiny_model_dir)
    engine = refit.Engine(fake.url, timeout_s=60)
    _refit(engine, weight_set(tmp_path, 1), "one")
    wire = CorruptWire(monkeypatch, bucket=1, times=1)
    second = weight_set(tmp_path, 2)
    stats = _refit(engine, second, "two")
    assert wire.hits == 1
    assert stats.verify_failed == (fake.url,) and "retry_transfer" in stats.seconds
    assert stats.bytes_sent > stats.num_bytes  # the first attempt's buckets, then all of them again
    state = fake.state()
    assert state["version"] == "two" and not state["paused"]
    assert state["sums"] == pytest.approx(_sums(second), abs=1e-6)


def test_a_refit_that_fails_verification_twice_is_reported_and_the_engine_kept_paused(
    fake_engine_factory, tiny_model_dir, tmp_path, monkeypatch
):
    fake = fake_engine_factory(tiny_model_dir)
    engine = refit.Engine(fake.url, timeout_s=60)
    first = weight_set(tmp_path, 3)
    _refit(engine, first, "one")
    CorruptWire(monkeypatch, bucket=2, times=2)
    with pytest.raises(refit.RefitError, match="phase 'verify'.*bucket 2") as failure:
        _refit(engine, weight_set(tmp_path, 4), "two")
    assert failure.value.paused == [fake.url]
    assert engine.verify_report()[0]["failed"] == 2
    state = fake.state()
    assert state["version"] == "one" and state["paused"]
    assert state["sums"] == pytest.approx(_sums(first), abs=1e-6)  # nothing of the bad refit kept
    monkeypatch.undo()
    wire = CorruptWire(monkeypatch, bucket=1, times=1)  # the next refit, once corrupted, recovers
    third = weight_set(tmp_path, 5)
    assert _refit(engine, third, "three").verify_failed == (fake.url,) and wire.hits == 1
    assert fake.state()["sums"] == pytest.approx(_sums(third), abs=1e-6)


def test_delta_refits_send_what_changed_and_leave_the_engine_with_the_trainers_bf16_bytes(
    fake_engine_factory, tiny_model_dir, tmp_path, monkeypatch
):
    fake = fake_engine_factory(tiny_model_dir)
    engine = refit.Engine(fake.url, timeout_s=60)
    model = weight_set(tmp_path, 5)
    first = _refit(engine, model, 0, delta=True, dtype=torch.bfloat16)
    assert first.bytes_sent == first.num_bytes  # nothing to diff against yet: every bucket whole
    wire = None
    for step in range(1, 5):
        model = nudged(model, fraction=0.01, seed=step)
        if step == 3:  # a flipped byte in a patch: the check fails, the engine rolls back, full retry
            wire = CorruptWire(monkeypatch, bucket=1, times=1)
        stats = _refit(engine, model, step, delta=True, dtype=torch.bfloat16)
        assert fake.state()["sums"] == pytest.approx(_sums(model, torch.bfloat16), rel=1e-12, abs=0)
        if step == 3:
            assert wire.hits == 1 and stats.verify_failed == (fake.url,)
        else:
            assert stats.verify_failed == () and stats.bytes_sent < stats.num_bytes / 4
    assert fake.state()["version"] == "4"


class _FailingParams(refit.FullParams):
    """The trainer's parameter stream, failing after `after` parameters (a rank lost mid-gather)."""

    def __init__(self, module, after: int, dtype) -> None:
        super().__init__(module, dtype=dtype)
        self.after = after

    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if i == self.after:
                raise RuntimeError("trainer lost a rank")
            yield item


def test_a_delta_refit_the_trainer_aborts_keeps_the_engines_bytes_and_the_next_one_goes_whole(
    fake_engine_factory, tiny_model_dir, tmp_path
):
    fake = fake_engine_factory(tiny_model_dir)
    engine = refit.Engine(fake.url, timeout_s=60)
    model = weight_set(tmp_path, 6)
    _refit(engine, model, "one", delta=True, dtype=torch.bfloat16)
    broken = nudged(model, fraction=0.01, seed=1)
    with pytest.raises(refit.RefitError, match="phase 'transfer'.*trainer lost a rank"):
        params = _FailingParams(broken, after=12, dtype=torch.bfloat16)
        refit.update_weights([engine], params, version="x", bucket_bytes=SMALL_BUCKETS, delta=True)
    state = fake.state()
    assert state["version"] == "one" and state["paused"]
    assert state["sums"] == pytest.approx(_sums(model, torch.bfloat16), rel=1e-12, abs=0)
    # The engine failed that refit and the trainer's copy is half rewritten: the next refit goes whole.
    model = nudged(model, fraction=0.01, seed=2)
    stats = _refit(engine, model, "two", delta=True, dtype=torch.bfloat16)
    assert stats.bytes_sent == stats.num_bytes and stats.verify_failed == ()
    assert fake.state()["sums"] == pytest.approx(_sums(model, torch.bfloat16), rel=1e-12, abs=0)
    model = nudged(model, fraction=0.01, seed=3)
    stats = _refit(engine, model, "three", delta=True, dtype=torch.bfloat16)
    assert stats.bytes_sent < stats.num_bytes / 4  # and deltas resume from there
    assert fake.state()["sums"] == pytest.approx(_sums(model, torch.bfloat16), rel=1e-12, abs=0)
