"""Capture, continuation and reply parsing, without an engine."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tito import Capture, Generation
from tito._chat import ChatRenderer, ChatState, parse_reply
from tito._protocol import TextStream


def test_extension_appends_only_new_tokens_and_sampled_tokens_keep_logprob_and_version():
    capture = Capture("s")
    capture.commit_turn([1, 2, 3], [], Generation([7, 8], [-0.1, -0.2], [(4, 0, 1), (5, 1, 2)]))
    capture.commit_turn([1, 2, 3, 7, 8, 9], [], Generation([10], [-0.3]))
    (segment,) = capture.trajectory().segments
    assert segment.token_ids == [1, 2, 3, 7, 8, 9, 10]
    assert segment.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert segment.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert segment.versions == [-1, -1, -1, 4, 5, -1, 0]


def test_a_prefix_rewrite_seals_the_segment_and_opens_another():
    capture = Capture("s")
    capture.commit_turn([1, 2, 3], [], Generation([7], [-0.1]))
    capture.commit_turn([1, 9], [], Generation([5], [-0.3], [(1, 0, 1)]))
    first, second = capture.trajectory().segments
    assert first.token_ids == [1, 2, 3, 7]
    assert second.token_ids == [1, 9, 5]
    assert second.loss_mask == [0, 0, 1]


def test_a_retry_replaces_the_previous_reply_instead_of_duplicating():
    capture = Capture("s")
    capture.commit_turn([1, 2], [], Generation([7, 8], [-0.1, -0.2]))
    capture.commit_turn([1, 2], [], Generation([9], [-0.4], [(1, 0, 1)]), retry=True)
    (segment,) = capture.trajectory().segments
    assert segment.token_ids == [1, 2, 9]
    assert segment.loss_mask == [0, 0, 1]
    assert capture.replies == [[9]]


def test_a_retry_of_a_turn_that_sampled_nothing_replaces_its_turn():
    capture = Capture("s")
    capture.commit_turn([1, 2], [], Generation([], [], finish_reason="abort"))
    capture.commit_turn([1, 2], [], Generation([9], [-0.4]), retry=True)
    trajectory = capture.trajectory()
    assert trajectory.segments[0].token_ids == [1, 2, 9]
    assert [(turn.start, turn.num_sampled, turn.finish_reason) for turn in trajectory.turns] == [(2, 1, None)]


def test_a_resample_is_kept_and_a_conversation_goes_on_from_the_reply_it_kept():
    """The same prompt again without `retry` is a second sample: a segment of its own. A prompt that goes
    on from the first sample extends the first segment, so the reply the agent kept is trained."""
    capture = Capture("s")
    capture.commit_turn([1, 2], [], Generation([7, 8], [-0.1, -0.2]))
    capture.commit_turn([1, 2], [], Generation([9], [-0.4], [(1, 0, 1)]))
    assert capture.tokens == [1, 2, 9]
    capture.commit_turn([1, 2, 7, 8, 3], [], Generation([5], [-0.5], [(2, 0, 1)]))
    first, second = capture.trajectory().segments
    assert (first.token_ids, first.loss_mask) == ([1, 2, 7, 8, 3, 5], [0, 0, 1, 1, 0, 1])
    assert (second.token_ids, second.loss_mask) == ([1, 2, 9], [0, 0, 1])
    assert capture.replies == [[7, 8], [9], [5]]
    assert [(turn.segment, turn.start) for turn in capture.turns] == [(0, 2), (1, 2), (0, 5)]


def _routes(rows: int) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((rows, 2, 1), dtype=np.uint8))
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(Generation([7, 8], [-0.1]), id="fewer-logprobs-than-tokens"),
        pytest.param(Generation([7], [-0.1], routed_experts=_routes(9)), id="routes-past-the-segment"),
    ],
)
@pytest.mark.parametrize(
    ("prompt", "retry"),
    [
        pytest.param([1, 2, 5, 3], False, id="extension"),
        pytest.param([1, 9], False, id="rewrite"),
        pytest.param([1, 2], False, id="resample"),
        pytest.param([1, 2], True, id="retry"),
    ],
)
def test_a_malformed_reply_leaves_the_capture_as_it_was(reply, prompt, retry):
    """The engine's reply is checked before the turn is placed: no orphan prompt tokens, no empty new
    segment, no retried reply dropped for a reply that is refused."""
    capture = Capture("s")
    capture.commit_turn([1, 2], [], Generation([5], [-0.1]))
    before = capture.trajectory()
    with pytest.raises(ValueError):
        capture.commit_turn(prompt, [], reply, retry=retry)
    assert capture.trajectory() == before and capture.replies == [[5]] and capture.tokens == [1, 2, 5]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda c: c.commit_turn([], [], Generation([1], [-0.1])), id="empty-prompt"),
        pytest.param(lambda c: c.commit_turn([1], [], Generation([1, 2], [-0.1])), id="ragged-sample"),
    ],
)
def test_malformed_capture_input_is_refused(bad):
    capture = Capture("s")
    with pytest.raises(ValueError):
        bad(capture)


def test_trajectory_is_a_copy():
    capture = Capture("s")
    capture.commit_turn([1], [], Generation([2], [-0.1]))
    snapshot = capture.trajectory()
    capture.commit_turn([1, 2, 3], [], Generation([4], [-0.1]))
    assert snapshot.segments[0].token_ids == [1, 2]


@pytest.fixture
def renderer(tokenizer):
    return ChatRenderer(tokenizer)


def test_turn_end_is_probed_from_the_template(renderer):
    assert renderer.turn_end == "<|im_end|>\n"


@pytest.mark.parametrize(
    ("sampled", "closing"),
    [
        pytest.param(["f", "<|im_end|>"], ["\n"], id="the-engine-sampled-the-eos"),
        pytest.param(["f", "<"], ["<|im_end|>", "\n"], id="cut-on-a-character-that-begins-the-eos-text"),
        pytest.param(["f", "o"], ["<|im_end|>", "\n"], id="cut-elsewhere"),
        pytest.param([], ["<|im_end|>", "\n"], id="nothing-sampled"),
    ],
)
def test_closing_skips_only_a_turn_end_token_the_engine_sampled(renderer, tokenizer, sampled, closing):
    ids = renderer.closing_ids(tokenizer.convert_tokens_to_ids(sampled))
    assert tokenizer.convert_ids_to_tokens(ids) == closing


def test_a_continuation_keeps_the_sampled_ids_of_an_assistant_turn(renderer, tokenizer):
    """The engine sampled "fox" as three characters; the trace keeps them, never the canonical token."""
    capture, state = Capture("s"), ChatState()
    first = [{"role": "user", "content": "copy the word: fox"}]
    prompt = state.prompt(renderer, capture.tokens, first, None)
    sampled = tokenizer.convert_tokens_to_ids(["f", "o", "x"]) + [tokenizer.eos_token_id]
    assert tokenizer(["fox"], add_special_tokens=False)["input_ids"][0] != sampled[:3]
    capture.commit_turn(prompt.token_ids, [], Generation(sampled, [-1.0] * 4))
    reply = {"role": "assistant", "content": "fox"}
    state.record(first, None, prompt, reply, renderer.closing_ids(sampled))

    second = [*first, reply, {"role": "user", "content": "again"}]
    prompt2 = state.prompt(renderer, capture.tokens, second, None).token_ids
    assert prompt2[: len(capture.tokens)] == capture.tokens
    appended = tokenizer.decode(prompt2[len(capture.tokens) :])
    assert appended == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    capture.commit_turn(prompt2, [], Generation([5], [-1.0]))
    (segment,) = capture.trajectory().segments
    start = len(prompt.token_ids)
    assert segment.token_ids[start : start + 4] == sampled


def test_a_rewritten_history_renders_afresh(renderer):
    capture, state = Capture("s"), ChatState()
    messages = [{"role": "user", "content": "copy the word: fox"}]
    prompt = state.prompt(renderer, capture.tokens, messages, None)
    state.record(messages, None, prompt, {"role": "assistant", "content": "fox"}, [])
    compacted = [
        {"role": "user", "content": "summary"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "go"},
    ]
    fresh = renderer.encode(renderer.render(compacted, None, add_generation_prompt=True))
    assert state.prompt(renderer, [1, 2, 3], compacted, None).token_ids == fresh


def test_tool_call_arguments_as_string_or_object_count_as_the_same_turn(renderer):
    capture, state = Capture("s"), ChatState()
    messages = [{"role": "user", "content": "add"}]
    prompt = state.prompt(renderer, capture.tokens, messages, None)
    call = {"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 1}}}
    state.record(messages, None, prompt, {"role": "assistant", "content": "", "tool_calls": [call]}, [5])
    echoed = {**call, "function": {"name": "add", "arguments": '{"a":1}'}}
    follow = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [echoed]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    trace = [9, 9, 9]
    assert state.prompt(renderer, trace, follow, None).token_ids[:4] == [9, 9, 9, 5]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        pytest.param("hello", "hello", [], id="plain"),
        pytest.param(
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
            "",
            [("add", {"a": 1})],
            id="one-call",
        ),
        pytest.param(
            'hi<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
            '<tool_call>{"name": "g"}</tool_call>',
            "hi",
            [("f", {"x": 2}), ("g", {})],
            id="two-calls",
        ),
        pytest.param(
            '<tool_call>{"name": "add", "arguments": {</tool_call>',
            '<tool_call>{"name": "add", "arguments": {</tool_call>',
            [],
            id="malformed-json-stays-text",
        ),
        pytest.param(
            '<tool_call>["add"]</tool_call>', '<tool_call>["add"]</tool_call>', [], id="not-an-object"
        ),
        pytest.param('<tool_call>{"name": "add"', '<tool_call>{"name": "add"', [], id="unterminated"),
    ],
)
def test_parse_reply(text, content, calls):
    parsed = parse_reply(text)
    assert parsed.content == content
    assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == calls
    assert all(c["id"].startswith("call_") for c in parsed.tool_calls)


def test_text_stream_never_sends_a_stop_string_or_a_tool_call(tokenizer):
    ids = tokenizer('ab STOP cd<tool_call>{"name": "f"}</tool_call>', add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stops=["STOP"], hold_tool_calls=True)
    sent = "".join(stream.push([token]) for token in ids)
    assert sent == "ab "
    assert stream.finish() == "ab " and stream.stop == "STOP"

    stream = TextStream(tokenizer, stops=None, hold_tool_calls=True)
    sent = "".join(stream.push([token]) for token in ids)
    assert sent == "ab STOP cd"


def test_the_first_stop_string_in_the_text_ends_the_reply(tokenizer):
    ids = tokenizer("one END two HALT three", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, stops=["HALT", "END"], hold_tool_calls=False)
    stream.push(ids)
    assert stream.finish() == "one " and stream.stop == "END"
    plain = TextStream(tokenizer, stops=["NEVER"], hold_tool_calls=False)
    plain.push(ids)
    assert plain.finish() == "one END two HALT three" and plain.stop is None
