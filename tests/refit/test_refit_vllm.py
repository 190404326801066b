"""Refit into a real vLLM CPU server (the refit_gloo backend): correctness, partial rollout, failures,
verification of every refit (a byte corrupted on the wire) and delta refit."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
import torch
from refit_helpers import (
    PROMPTS,
    CorruptWire,
    generate,
    load_model,
    max_logprob_error,
    nudged,
    reference_logprobs,
    weight_set,
)

import refit

pytestmark = pytest.mark.slow
TOL = 1e-4  # fp32 engine vs fp32 transformers
SMALL_BUCKETS = 64 << 10  # several buckets for the 350 KB tiny model


def _prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M))


def _prefix_cache_resets(log_path) -> int:
    """Resets of the engine's prefix cache so far (vLLM's block pool logs each one)."""
    return log_path.read_text(errors="replace").count("Successfully reset prefix cache")


def test_refit_matches_transformers_for_two_weight_sets_and_clears_the_prefix_cache(
    refit_servers, tiny_model_dir, tmp_path
):
    server = refit_servers.serve(tiny_model_dir)
    engine = refit.Engine(server.url)
    long_prompt = [(7 * i) % 90 + 5 for i in range(300)]  # several KV blocks, so the cache can hit
    assert max_logprob_error(server.url, load_model(tiny_model_dir), prompts=[long_prompt]) < TOL
    hits = _prefix_cache_hits(server.url)
    generate(server.url, long_prompt, 2)
    assert _prefix_cache_hits(server.url) > hits, "the long prompt should be served from the prefix cache"

    for seed in (11, 12):
        model = weight_set(tmp_path, seed)
        resets = _prefix_cache_resets(server.log_path)
        stats = refit.update_weights(
            [engine], refit.full_params(model), version=seed, bucket_bytes=SMALL_BUCKETS
        )
        assert stats.num_buckets > 1 and stats.version == str(seed)
        assert _prefix_cache_resets(server.log_path) == resets + 1  # one walk over the KV cache a refit
        # The cached prompt must be recomputed with the new weights, not served from stale KV.
        assert max_logprob_error(server.url, model, prompts=[*PROMPTS, long_prompt]) < TOL
        out = generate(server.url, PROMPTS[0], 4)
        assert out["weight_versions"] == [{"version": str(seed), "start": 0, "end": 4}]
        assert engine.weight_version() == str(seed) and not engine.is_paused()
    engine.close()


def test_request_in_flight_finishes_across_the_refit_with_both_versions(
    refit_servers, tiny_model_dir, tmp_path
):
    server = refit_servers.serve(tiny_model_dir)
    engine = refit.Engine(server.url)
    old, new = weight_set(tmp_path, 21), weight_set(tmp_path, 22)
    refit.update_weights([engine], refit.full_params(old), version="old")
    params = {"max_tokens": 1500, "temperature": 1.0, "seed": 0, "ignore_eos": True, "logprobs": 0,
              "flat_logprobs": True}  # fmt: skip
    body = {"token_ids": PROMPTS[1], "sampling_params": params, "stream": True}
    choices: list[dict] = []
    sampling = threading.Event()  # set once the request's first tokens are in
    request = threading.Thread(
        target=lambda: choices.extend(_streamed(server.url, "/refit/generate", body, arrived=sampling))
    )
    request.start()
    assert sampling.wait(timeout=120)  # in flight: the refit lands while it samples, not before or after
    refit.update_weights([engine], refit.full_params(new), version="new", bucket_bytes=SMALL_BUCKETS)
    request.join(timeout=300)

    token_ids, logprobs, versions, _ = _joined(choices, lambda choice: choice["token_logprobs"])
    assert len(token_ids) == 1500
    switch = versions.index("new") if "new" in versions else len(versions)
    assert versions == ["old"] * switch + ["new"] * (1500 - switch) and 0 < switch < 1500
    # Every token keeps the logprob it was sampled with: old weights before the switch, new after
    # (the kept request's KV was recomputed with the new weights, not reused).
    engine_logp = torch.tensor(logprobs)
    for model, part in ((old, slice(0, switch)), (new, slice(switch, 1500))):
        want = reference_logprobs(model, PROMPTS[1], token_ids)
        torch.testing.assert_close(engine_logp[part], want[part], rtol=0, atol=TOL)
    engine.close()


def _streamed(url: str, path: str, body: dict, arrived: threading.Event | None = None) -> list[dict]:
    """The choices of every event of a streamed generate reply; `arrived` is set at its first event."""
    choices = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choices += json.loads(line[6:])["choices"]
                if arrived is not None:
                    arrived.set()
    return choices


def _joined(choices: list[dict], logprobs) -> tuple[list, list, list, str]:
    """A streamed reply's tokens, their logprobs (`logprobs(choice)`: a chunk's), each token's weight
    version and the finish reason (how the tokens split into events varies run to run)."""
    versions = {
        i: s["version"] for c in choices for s in c["weight_versions"] for i in range(s["start"], s["end"])
    }
    tokens = [t for c in choices for t in c["token_ids"]]
    return (
        tokens,
        [lp for c in choices for lp in logprobs(c)],
        [versions[i] for i in range(len(tokens))],
        choices[-1]["finish_reason"],
    )


def test_the_compact_route_streams_vllms_tokens_logprobs_and_versions_and_refuses_alike(
    refit_servers, tiny_model_dir
):
    server = refit_servers.serve(tiny_model_dir)
    params = {"max_tokens": 40, "temperature": 1.0, "seed": 3, "ignore_eos": True, "logprobs": 0}
    body = {"token_ids": PROMPTS[0], "sampling_params": params, "stream": True}
    theirs = _joined(
        _streamed(server.url, "/inference/v1/generate", body),
        lambda choice: [item["logprob"] for item in choice["logprobs"]["content"]],
    )
    assert len(theirs[0]) == len(theirs[1]) == 40 and theirs[3] == "length"
    flat = {**body, "sampling_params": {**params, "flat_logprobs": True}}
    for ask in (body, flat):  # the same tokens, logprobs (bit for bit) and versions
        assert _joined(_streamed(server.url, "/refit/generate", ask), lambda c: c["token_logprobs"]) == theirs
    no_logprobs = {**body, "sampling_params": {**params, "logprobs": None}}
    unasked = _streamed(server.url, "/refit/generate", no_logprobs)
    assert "token_logprobs" not in unasked[0] and sum(len(c["token_ids"]) for c in unasked) == 40

    malformed = httpx.post(f"{server.url}/refit/generate", json={"sampling_params": params}, timeout=30)
    assert malformed.status_code == 400 and "token_ids" in malformed.text
    for path in ("/refit/generate", "/inference/v1/generate"):  # vLLM's refusal, its status kept
        unknown = httpx.post(f"{server.url}{path}", json={**body, "model": "nope"}, timeout=30)
        assert unknown.status_code == 404 and "nope" in unknown.text, (path, unknown.text)


def test_mismatch_is_refused_before_any_engine_is_touched(refit_servers, tiny_model_dir, tmp_path):
    server = refit_servers.serve(tiny_model_dir)
    engine = refit.Engine(server.url)
    asked, ask = [], engine._rpc
    engine._rpc = lambda method, **kwargs: asked.append(method) or ask(method, **kwargs)
    version = engine.weight_version()
    wrong_shape = weight_set(tmp_path, 31, hidden_size=32)
    with pytest.raises(ValueError, match="shape mismatch.*model.embed_tokens.weight"):
        refit.update_weights([engine], refit.full_params(wrong_shape), version="never")
    extra_layer = weight_set(tmp_path, 32, num_layers=3)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.2"):
        refit.update_weights([engine], refit.full_params(extra_layer), version="never")
    assert engine.channel is None, "no transfer group was opened"
    assert engine.weight_version() == version and not engine.is_paused()
    assert asked == ["refit_checkpoint_specs"]  # the engine's checkpoint was asked for once
    engine.close()


class _FailingParams(refit.FullParams):
    """The trainer's parameter stream, failing (or running `on_fail`) after `after` parameters."""

    def __init__(self, module, after: int, on_fail=None) -> None:
        super().__init__(module)
        self.after, self.on_fail = after, on_fail

    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if i == self.after:
                if self.on_fail is None:
                    raise RuntimeError("trainer lost a rank")
                self.on_fail()
            yield item


def test_trainer_failure_mid_transfer_rolls_back_and_keeps_the_engine_paused(
    refit_servers, tiny_model_dir, tmp_path
):
    server = refit_servers.serve(tiny_model_dir)
    engine = refit.Engine(server.url)
    before = weight_set(tmp_path, 41)
    refit.update_weights([engine], refit.full_params(before), version="before")
    with pytest.raises(refit.RefitError, match="phase 'transfer'.*trainer lost a rank") as failure:
        refit.update_weights(
            [engine],
            _FailingParams(weight_set(tmp_path, 42), after=12),
            version="x",
            bucket_bytes=SMALL_BUCKETS,
        )
    assert failure.value.paused == [server.url] and failure.value.updated == []
    assert engine.is_paused() and engine.weight_version() == "before"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # alive, no meta layers
    # A full refit afterwards succeeds and resumes it.
    after = weight_set(tmp_path, 43)
    refit.update_weights([engine], refit.full_params(after), version="after", bucket_bytes=SMALL_BUCKETS)
    assert not engine.is_paused() and max_logprob_error(server.url, after) < TOL
    engine.close()


def test_engine_dying_mid_refit_is_named_and_the_others_are_updated(
    refit_servers, tiny_model_dir, tmp_path, fake_engine_factory
):
    server = refit_servers.serve(tiny_model_dir)
    fake = fake_engine_factory(tiny_model_dir)
    real, doomed = refit.Engine(server.url), refit.Engine(fake.url, timeout_s=30)
    first = weight_set(tmp_path, 51)
    refit.update_weights(
        [real, doomed], refit.full_params(first), version="first", bucket_bytes=SMALL_BUCKETS
    )
    state = fake.state()
    assert state["version"] == "first" and not state["paused"]
    for name, param in first.named_parameters():  # the fake received every byte
        assert state["sums"][name] == pytest.approx(float(param.detach().double().sum()), abs=1e-6)

    second = weight_set(tmp_path, 52)
    params = _FailingParams(second, after=12, on_fail=fake.kill)
    with pytest.raises(refit.RefitError) as failure:
        refit.update_weights([real, doomed], params, version="second", bucket_bytes=SMALL_BUCKETS)
    phase, _ = failure.value.failures[fake.url]
    assert phase == "transfer" and list(failure.value.failures) == [fake.url]
    assert failure.value.updated == [server.url] and fake.url in str(failure.value)
    assert real.weight_version() == "second" and not real.is_paused()
    assert max_logprob_error(server.url, second) < TOL
    real.close()
    doomed.close()


def test_a_byte_corrupted_on_the_wire_rolls_back_and_a_full_refit_recovers(
    refit_servers, tiny_model_dir, tmp_path, monkeypatch
):
    server = refit_servers.serve(tiny_model_dir)
    engine = refit.Engine(server.url)
    before = weight_set(tmp_path, 61)
    refit.update_weights([engine], refit.full_params(before), version="before", bucket_bytes=SMALL_BUCKETS)
    # Both attempts corrupted: the engine refuses bucket 2, rolls back, stays paused on its old version.
    CorruptWire(monkeypatch, bucket=2, times=2)
    with pytest.raises(refit.RefitError, match="phase 'verify'.*bucket 2 .*CRC-32") as failure:
        refit.update_weights(
            [engine], refit.full_params(weight_set(tmp_path, 62)), version="x", bucket_bytes=SMALL_BUCKETS
        )
    assert failure.value.paused == [server.url]
    assert engine.verify_report()[0]["failed"] == 2 and engine.verify_report()[0]["checked"] == 2
    assert engine.is_paused() and engine.weight_version() == "before"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # alive, no meta layers
    monkeypatch.undo()

    # One corrupted send: the refit rolls back, retries in full by itself and serves the new weights.
    wire = CorruptWire(monkeypatch, bucket=1, times=1)
    after = weight_set(tmp_path, 63)
    stats = refit.update_weights(
        [engine], refit.full_params(after), version="after", bucket_bytes=SMALL_BUCKETS
    )
    assert wire.hits == 1 and stats.verify_failed == (server.url,)
    assert engine.verify_report()[0] == {"checked": stats.num_buckets, "failed": None, "error": ""}
    assert not engine.is_paused() and engine.weight_version() == "after"
    assert max_logprob_error(server.url, after) < TOL
    engine.close()


def test_delta_refits_serve_exactly_the_trainers_weights_also_after_a_rollback(
    refit_servers, tiny_model_dir, tmp_path, monkeypatch
):
    server = refit_servers.serve(tiny_model_dir)
    engine = refit.Engine(server.url)
    model = weight_set(tmp_path, 71)

    def delta_refit(version):
        params = refit.full_params(model)
        return refit.update_weights([engine], params, version=version, bucket_bytes=SMALL_BUCKETS, delta=True)

    first = delta_refit("d0")
    assert first.bytes_sent == first.num_bytes  # no base yet: every bucket whole
    for step in range(1, 5):
        model = nudged(model, fraction=0.02, seed=70 + step)  # 2% of each parameter's elements move
        wire = CorruptWire(monkeypatch, bucket=1, times=1) if step == 2 else None
        stats = delta_refit(f"d{step}")
        if wire is not None:  # a flipped byte in a patch: rolled back, retried in full
            assert wire.hits == 1 and stats.verify_failed == (server.url,)
            monkeypatch.undo()
        else:  # fp32 elements: an int32 index and a value per changed one
            assert stats.verify_failed == () and stats.bytes_sent < stats.num_bytes / 10
        assert engine.weight_version() == f"d{step}" and not engine.is_paused()
        assert max_logprob_error(server.url, model) < TOL
    engine.close()
