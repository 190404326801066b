"""What a streamed reply's tokens cost vLLM's API server, with and without the sampled token's logprob.

tito asks every token's logprob (`logprobs=0`) and, by default, every reply streamed, `--stream-interval`
tokens an event. Per event, vLLM 0.26's API server process runs three stages that this script times
alone, in this process, with vLLM's own classes and refit's middleware, on random token ids:

  processor   the output processor's update of a request's logprobs after each engine step
              (`append_logprobs_for_next_position`: a dict and a `Logprob` per token, or with
              `flat_logprobs` a few flat lists); nothing to do without logprobs
  endpoint    the token endpoint's SSE event (`/inference/v1/generate`): its choice, with logprobs a
              `ChatCompletionLogProbsContent` and a `ChatCompletionLogProb` per token, dumped to JSON;
              `compact`: refit's compact route's event instead (`refit.vllm_compact`, what tito asks
              Molt's engines for: the sampled logprobs read from flat lists, encoded as bare floats)
  middleware  `refit.vllm_versions.WeightVersions` decoding the event, adding `weight_versions` and
              encoding it again

It prints each stage's microseconds a token (median of `--repeats` timings of `--events` events) with
and without logprobs, the totals (vLLM's endpoint with the dict processor, refit's compact route with the
flat one) and their ratios, and the events' sizes. The engine-side costs (the engine
core's logprobs, the transport between the two processes) are not in it.

    uv run python bench/token_endpoint.py               # ~10 s on the 2-core CPU
    uv run python bench/token_endpoint.py --tokens 1    # events of one token (--stream-interval 1)
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import vllm
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateResponseStreamChoice,
    GenerateStreamResponse,
)
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
from vllm.logprobs import Logprob, append_logprobs_for_next_position, create_sample_logprobs
from vllm.outputs import CompletionOutput

from refit.vllm_compact import compact_event
from refit.vllm_versions import _InFlight, _Labeller


def event(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> bytes:
    """The endpoint's SSE event for one choice's new tokens (its `serve_tokens_stream_generator`)."""
    content = None
    if logprobs is not None:  # the method reads nothing from its instance
        endpoint = object.__new__(ServingTokens)
        content = endpoint._create_tokens_logprobs(token_ids, logprobs, num_output_top_logprobs=0)
    choice = GenerateResponseStreamChoice(index=0, logprobs=content, finish_reason=None, token_ids=token_ids)
    reply = GenerateStreamResponse(request_id="generate-tokens-0", choices=[choice])
    return f"data: {reply.model_dump_json()}\n\n".encode()


def per_token_us(stage, events: int, tokens: int, repeats: int) -> float:
    """Median over `repeats` of `events` calls of `stage`, in microseconds a token."""
    for _ in range(events // 10):
        stage()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(events):
            stage()
        times.append((time.perf_counter() - start) / (events * tokens) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens an event (--stream-interval)")
    parser.add_argument("--events", type=int, default=2000, help="events a timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings a stage (the median is printed)")
    args = parser.parse_args()

    rng = random.Random(0)
    token_ids = [rng.randrange(151_936) for _ in range(args.tokens)]
    logprobs = [{t: Logprob(logprob=-rng.random(), rank=1, decoded_token=None)} for t in token_ids]
    with_lp, without_lp = event(token_ids, logprobs), event(token_ids, None)

    def processor(flat: bool):
        """The output processor's logprobs of one event's tokens, a dict a token or `flat`."""
        kept = create_sample_logprobs(flat)
        for token_id, entry in zip(token_ids, logprobs, strict=True):
            append_logprobs_for_next_position(kept, [token_id], [entry[token_id].logprob], [None], 1, 0)
        return kept

    output = CompletionOutput(0, "", token_ids, None, processor(flat=True))  # as the route gets it
    compact_lp, compact_without = compact_event(output, logprobs=True), compact_event(output, logprobs=False)
    labeller = _Labeller(_InFlight("default"), send=None)
    stages = {  # name -> (with logprobs, without)
        "processor": (lambda: processor(flat=False), None),
        "processor, flat_logprobs": (lambda: processor(flat=True), None),
        "endpoint": (lambda: event(token_ids, logprobs), lambda: event(token_ids, None)),
        "middleware": (lambda: labeller._events(with_lp), lambda: labeller._events(without_lp)),
        "compact endpoint": (
            lambda: compact_event(output, logprobs=True),
            lambda: compact_event(output, logprobs=False),
        ),
        "middleware, compact": (
            lambda: labeller._events(compact_lp),
            lambda: labeller._events(compact_without),
        ),
    }

    def time_it(stage) -> float:
        return per_token_us(stage, args.events, args.tokens, args.repeats) if stage else 0.0

    rows = {name: (time_it(w), time_it(wo)) for name, (w, wo) in stages.items()}
    machine = platform.processor() or platform.machine()
    print(f"{machine}, Python {platform.python_version()}, vLLM {vllm.__version__}")
    print(f"events of {args.tokens} token(s): {len(with_lp)} bytes with logprobs, {len(without_lp)} without")
    print(f"compact events: {len(compact_lp)} bytes with logprobs, {len(compact_without)} without")
    print("| stage | us a token, logprobs | us a token, none |\n| --- | ---: | ---: |")
    for name, (w, wo) in rows.items():
        print(f"| {name} | {w:.2f} | {wo:.2f} |")
    total = sum(rows[name][0] for name in ("processor", "endpoint", "middleware"))
    base = sum(rows[name][1] for name in ("processor", "endpoint", "middleware"))
    compact_stages = ("processor, flat_logprobs", "compact endpoint", "middleware, compact")
    small, small_base = (sum(rows[name][i] for name in compact_stages) for i in (0, 1))
    print(f"| total, vLLM's endpoint (dict processor) | {total:.2f} | {base:.2f} |")
    print(f"| total, compact route (flat processor) | {small:.2f} | {small_base:.2f} |")
    print(f"with logprobs, vLLM's endpoint / the compact route: {total / small:.1f}x")
    share = rows["endpoint"][0] / total
    print(f"with logprobs / without: {total / base:.1f}x; the endpoint's share of the total: {share:.0%}")


if __name__ == "__main__":
    main()
