"""Agent frameworks, unchanged, against tito on loopback in front of the real vLLM CPU engine.

The tiny random model calls a tool only when told to, so the first model call forces one (the
frameworks' own tool_choice settings); the capture must be one segment whose sampled runs are exactly
the replies the framework reported (their token usage), each turn's prompt extending the last. The
frameworks come from the root pyproject's `harness` dependency group (a default group); without it
these tests skip, saying so.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
from test_tito_real_engine import sampled_runs

from tito import Trajectory

pytestmark = pytest.mark.slow


def now() -> str:
    """The time."""
    return "noon"


def captured(url: str, session: dict) -> Trajectory:
    return msgspec.json.decode(
        httpx.get(f"{url}/sessions/{session['id']}/trajectory").content, type=Trajectory
    )


def assert_token_exact(trajectory: Trajectory, output_tokens: list[int]) -> None:
    """One segment; one sampled run per model call, of the length the framework was told."""
    (segment,) = trajectory.segments
    assert [turn.num_sampled for turn in trajectory.turns] == output_tokens
    for turn in trajectory.turns:
        sampled = segment.loss_mask[turn.start : turn.start + turn.num_sampled]
        assert sampled == [1] * turn.num_sampled
    assert sum(len(run) for run in sampled_runs(segment)) == sum(output_tokens)
    assert all(segment.versions[i] == 0 for i, mask in enumerate(segment.loss_mask) if mask)


@pytest.mark.parametrize("model_kind", ["responses", "chat_completions"])
def test_openai_agents_sdk(real_tito, model_kind):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (uv sync --group harness)")
    import openai

    agents.set_tracing_disabled(True)
    _, url = real_tito
    session = httpx.post(f"{url}/sessions").json()

    async def run():
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused")
        model_class = (
            agents.OpenAIResponsesModel if model_kind == "responses" else agents.OpenAIChatCompletionsModel
        )
        agent = agents.Agent(
            name="clock",
            instructions="use tools",
            tools=[agents.function_tool(now)],
            model=model_class(model="tiny", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64),
            tool_use_behavior="stop_on_first_tool",  # a random model's free text would run to max_tokens
        )
        first = await agents.Runner.run(agent, "what time is it?")
        if model_kind == "responses":  # the Responses model continues the session's own response
            second = await agents.Runner.run(agent, "and now?", previous_response_id=first.last_response_id)
        else:
            second = await agents.Runner.run(
                agent, [*first.to_input_list(), {"role": "user", "content": "and now?"}]
            )
        await client.close()
        return first, second

    results = asyncio.run(run())
    assert [result.final_output for result in results] == ["noon", "noon"]
    usage = [response.usage.output_tokens for result in results for response in result.raw_responses]
    assert len(usage) == 2
    assert_token_exact(captured(url, session), usage)


def test_langchain_bind_tools_with_a_tool_call_history(real_tito):
    pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (uv sync --group harness)"
    )
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    _, url = real_tito
    session = httpx.post(f"{url}/sessions").json()
    llm = ChatOpenAI(model="tiny", base_url=session["base_url"], api_key="unused", max_tokens=64)
    history = [HumanMessage("what time is it?")]
    first = llm.bind_tools([now], tool_choice="now").invoke(history)
    (call,) = first.tool_calls
    assert call["name"] == "now"
    history += [first, ToolMessage(now(), tool_call_id=call["id"])]
    second = llm.bind_tools([now]).invoke(history)
    usage = [first.usage_metadata["output_tokens"], second.usage_metadata["output_tokens"]]
    assert_token_exact(captured(url, session), usage)


def test_pydantic_ai_agent(real_tito):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed (uv sync --group harness)")
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    _, url = real_tito
    session = httpx.post(f"{url}/sessions").json()

    async def run():
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused")
        model = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client))
        agent = Agent(model, instructions="answer briefly")
        settings = {"max_tokens": 8}
        first = await agent.run("copy the word: fox", model_settings=settings)
        second = await agent.run("again", message_history=first.all_messages(), model_settings=settings)
        await client.close()  # the client's connections belong to this event loop
        return second

    second = asyncio.run(run())
    replies = [m for m in second.all_messages() if isinstance(m, ModelResponse)]
    assert len(replies) == 2
    assert_token_exact(captured(url, session), [reply.usage.output_tokens for reply in replies])
