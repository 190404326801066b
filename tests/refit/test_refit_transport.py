"""The gloo wire between a trainer and an engine: every receive posted at once, and an aborted stream.

Both ends run in this process (two threads, a real two-rank gloo group over loopback); the engine end
is `refit._transport.Incoming`, which the vLLM worker and the fake engine both use.
"""

from __future__ import annotations

import threading

import pytest
import torch

from refit._transport import GlooChannel, Incoming, ReceiveBuffers, host_store, join_gloo_group

SIZES = [4096, 17, 100_000, 64]  # bytes per bucket, one of them odd


@pytest.fixture
def pipe():
    """(trainer channel, engine group) of one two-rank gloo group."""
    store = host_store("127.0.0.1", 30)
    box = {}
    engine = threading.Thread(
        target=lambda: box.update(group=join_gloo_group("127.0.0.1", store.port, 1, 2, 30))
    )
    engine.start()
    trainer = join_gloo_group("127.0.0.1", store.port, 0, 2, 30, store=store)
    engine.join()
    yield GlooChannel(trainer), box["group"]


def _payloads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for n in SIZES]


def _receive(group, out: dict, upto: int = len(SIZES)) -> threading.Thread:
    """The engine end on a thread: posts everything at once, waits bucket by bucket, then drains."""

    def run() -> None:
        incoming = Incoming(group, [torch.empty(n, dtype=torch.uint8) for n in SIZES])
        try:
            out["got"] = [incoming.wait(index).clone() for index in range(upto)]
        except RuntimeError as exc:
            out["error"] = exc
        finally:
            incoming.drain()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_every_bucket_arrives_in_order_into_its_own_buffer(pipe):
    channel, group = pipe
    for seed in (0, 1):  # twice over the same group: the second stream lines up with the first
        out, sent = {}, _payloads(seed)
        engine = _receive(group, out)
        works = [work for index, payload in enumerate(sent) for work in channel.send(index, payload)]
        for work in works:
            work.wait()
        engine.join(timeout=30)
        assert "error" not in out
        for got, want in zip(out["got"], sent, strict=True):
            assert torch.equal(got, want)


def test_an_aborted_stream_names_its_bucket_completes_and_leaves_the_group_usable(pipe):
    channel, group = pipe
    out, sent = {}, _payloads(2)
    engine = _receive(group, out)
    for work in channel.send(0, sent[0]):  # bucket 0 goes out, then the trainer fails
        work.wait()
    channel.abort(SIZES[1:])  # what update_weights does: the unsent buckets, as aborted junk
    engine.join(timeout=30)
    assert not engine.is_alive(), "the engine's posted receives must all complete"
    assert "aborted the transfer at bucket 1" in str(out["error"])

    out, sent = {}, _payloads(3)  # the next refit over the same group arrives whole
    engine = _receive(group, out)
    for work in [w for index, payload in enumerate(sent) for w in channel.send(index, payload)]:
        work.wait()
    engine.join(timeout=30)
    assert all(torch.equal(g, w) for g, w in zip(out["got"], sent, strict=True))


def test_receive_buffers_are_kept_between_refits_unless_a_weight_lives_in_them():
    buffers, model = ReceiveBuffers(), torch.nn.Linear(4, 4)
    first = buffers.carve(SIZES)
    assert [b.numel() for b in first] == SIZES
    assert all(b.data_ptr() % 64 == 0 for b in first)  # any dtype views from a bucket's start
    assert len({b.untyped_storage().data_ptr() for b in first}) == 1  # carved from one block
    assert not buffers.forget_if_used_by(list(model.parameters()))
    again = buffers.carve(SIZES)
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in first]  # kept: no fresh pages

    model.weight.data = again[2][:64].view(torch.float32).view(4, 4)  # a loader that aliased
    assert buffers.forget_if_used_by(list(model.parameters()))
    fresh = buffers.carve(SIZES)[2]
    assert fresh.untyped_storage().data_ptr() != again[2].untyped_storage().data_ptr()
