"""The gloo wire between a trainer and an engine: every receive posted at once, an aborted stream, the
CRC every bucket carries, and the delta stream (`refit._delta`) with its patches.

Both ends run in this process (two threads, a real two-rank gloo group over loopback); the engine end
is `refit._transport.Incoming`, which the vLLM worker and the fake engine both use.
"""

from __future__ import annotations

import threading

import torch

from refit._transport import Incoming, ReceiveBuffers, VerifyError, checksum

SIZES = [4096, 17, 100_000, 64]  # bytes per bucket, one of them odd


def _payloads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for n in SIZES]


def _send(channel, payloads, crcs=None) -> None:
    crcs = crcs or [checksum(p) for p in payloads]
    for work in [w for index, p in enumerate(payloads) for w in channel.send(index, p, crcs[index])]:
        work.wait()


def _receive(group, out: dict, upto: int = len(SIZES)) -> threading.Thread:
    """The engine end on a thread: posts everything at once, waits bucket by bucket, then drains."""

    def run() -> None:
        incoming = Incoming(group, [torch.empty(n, dtype=torch.uint8) for n in SIZES])
        out["got"] = []
        try:
            for index in range(upto):
                out["got"].append(incoming.wait(index).clone())
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
        _send(channel, sent)
        engine.join(timeout=30)
        assert "error" not in out
        for got, want in zip(out["got"], sent, strict=True):
            assert torch.equal(got, want)


def test_an_aborted_stream_names_its_bucket_completes_and_leaves_the_group_usable(pipe):
    channel, group = pipe
    out, sent = {}, _payloads(2)
    engine = _receive(group, out)
    for work in channel.send(0, sent[0], checksum(sent[0])):  # bucket 0 goes out, then the trainer fails
        work.wait()
    channel.abort(SIZES[1:])  # what update_weights does: the unsent buckets, as aborted junk
    engine.join(timeout=30)
    assert not engine.is_alive(), "the engine's posted receives must all complete"
    assert "aborted the transfer at bucket 1" in str(out["error"])

    out, sent = {}, _payloads(3)  # the next refit over the same group arrives whole
    engine = _receive(group, out)
    _send(channel, sent)
    engine.join(timeout=30)
    assert all(torch.equal(g, w) for g, w in zip(out["got"], sent, strict=True))


def test_one_flipped_byte_fails_its_bucket_the_stream_completes_and_the_next_one_passes(pipe):
    channel, group = pipe
    out, sent = {}, _payloads(4)
    crcs = [checksum(p) for p in sent]
    on_wire = [p.clone() for p in sent]
    on_wire[2][12345] ^= 0x01  # one bit of one byte, after the trainer took its CRC
    engine = _receive(group, out)
    _send(channel, on_wire, crcs)
    engine.join(timeout=30)
    assert not engine.is_alive()
    assert isinstance(out["error"], VerifyError) and "bucket 2" in str(out["error"])
    assert [torch.equal(g, w) for g, w in zip(out["got"], sent, strict=False)] == [True, True]

    out, sent = {}, _payloads(5)  # the group carries the retry as if nothing happened
    engine = _receive(group, out)
    _send(channel, sent)
    engine.join(timeout=30)
    assert "error" not in out and all(torch.equal(g, w) for g, w in zip(out["got"], sent, strict=True))


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
