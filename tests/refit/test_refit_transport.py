"""The gloo wire between a trainer and an engine: every receive posted at once, an aborted stream, the
CRC every bucket carries, and the delta stream (`refit._delta`) with its patches; and the device checksum
the GPU backends check each bucket with, here on CPU tensors (the same torch ops the GPU runs).

Both ends run in this process (two threads, a real two-rank gloo group over loopback); the engine end
is `refit._transport.Incoming`, which the vLLM worker and the fake engine both use.
"""

from __future__ import annotations

import threading

import pytest
import torch

import refit._transport
from refit._transport import (
    Incoming,
    ReceiveBuffers,
    VerifyError,
    checksum,
    device_checksum,
    verify_checksums,
)

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


def _weighted_word_sum(buffer_N: torch.Tensor) -> int:
    """The device checksum's formula, word by word in Python: sum_i (i + 1) * w_i over the bytes as
    little-endian int32 words (zero-padded to a multiple of 4), wrapped to int64."""
    data = bytes(buffer_N.tolist())
    data += bytes(-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]
    total = sum((i + 1) * w for i, w in enumerate(words)) % 2**64
    return total - 2**64 if total >= 2**63 else total


@pytest.mark.parametrize("num_bytes", [0, 3, 4, 17, 4096, 100_001])
@pytest.mark.parametrize("step_words", [5, refit._transport.CHECKSUM_WORDS])
def test_device_checksum_is_the_position_weighted_sum_of_the_words(num_bytes, step_words, monkeypatch):
    monkeypatch.setattr(refit._transport, "CHECKSUM_WORDS", step_words)  # 5: many steps, a partial last
    buffer_N = torch.randint(0, 256, (num_bytes,), generator=torch.Generator().manual_seed(num_bytes),
                             dtype=torch.uint8)  # fmt: skip
    got = device_checksum(buffer_N)
    assert got.dtype == torch.int64 and got.dim() == 0
    assert int(got) == _weighted_word_sum(buffer_N)


def test_device_checksum_wraps_in_int64_the_same_in_steps_as_in_one(monkeypatch):
    num_words = 1 << 22  # 16 MiB of 0x7f7f7f7f: the sum passes 2^63 many times over
    buffer_N = torch.full((4 * num_words,), 0x7F, dtype=torch.uint8)
    total = 0x7F7F7F7F * num_words * (num_words + 1) // 2 % 2**64
    want = total - 2**64 if total >= 2**63 else total
    assert int(device_checksum(buffer_N)) == want
    monkeypatch.setattr(refit._transport, "CHECKSUM_WORDS", 1000)
    assert int(device_checksum(buffer_N)) == want


def test_device_checksum_catches_a_flipped_byte_and_two_swapped_words():
    num_bytes, num_words = 300_003, 75_000
    buffer_N = torch.randint(
        0, 256, (num_bytes,), generator=torch.Generator().manual_seed(7), dtype=torch.uint8
    )
    clean = int(device_checksum(buffer_N))
    for at in (0, 1, 150_000, num_bytes - 1):  # the first word, inside a word, the middle, the padded tail
        for bit in (0x01, 0x80):
            flipped_N = buffer_N.clone()
            flipped_N[at] ^= bit
            assert int(device_checksum(flipped_N)) != clean, (at, bit)
    words_W = buffer_N[: 4 * num_words].view(torch.int32)
    # neighbours, far apart, and 65521 apart (where weights taken modulo 65521 would repeat)
    for i, j in [(0, 1), (17, 60_000), (5, 5 + 65521)]:
        assert words_W[i] != words_W[j]
        swapped_N = buffer_N.clone()
        swapped_W = swapped_N[: 4 * num_words].view(torch.int32)
        swapped_W[i], swapped_W[j] = words_W[j].item(), words_W[i].item()
        assert int(device_checksum(swapped_N)) != clean, (i, j)
    assert int(device_checksum(buffer_N.clone())) == clean  # and the same bytes agree


def test_verify_checksums_notes_every_bucket_and_names_the_first_that_differs():
    record = {"checked": 0, "failed": None, "error": "", "checksums": []}
    verify_checksums(record, [11, 12], [11, 12])
    assert record == {"checked": 2, "failed": None, "error": "", "checksums": [11, 12]}
    with pytest.raises(VerifyError, match="bucket 3 has device checksum 0x63"):
        verify_checksums(record, [13, 99, 15], [13, 14, 15], first=2)  # one call per bucket from 2 on
    assert record["failed"] == 3 and record["checked"] == 3 and "bucket 3" in record["error"]
    assert record["checksums"] == [11, 12, 13, 99, 15]
    fresh = {"checked": 0, "failed": None, "error": "", "checksums": []}
    with pytest.raises(VerifyError, match="2 buckets arrived, the trainer sent checksums of 3"):
        verify_checksums(fresh, [1, 2], [1, 2, 3])
    assert fresh["failed"] == 0
