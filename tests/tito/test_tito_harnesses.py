"""Agent frameworks, unchanged, against tito (fake engine: it scripts a well-formed tool call, which a
random tiny model does not write; test_tito_harnesses_real_engine.py runs them over real vLLM).

The frameworks come from the root pyproject's `harness` dependency group (a default group); without it
these tests skip, saying so.
"""

from __future__ import annotations

import pytest
from test_tito_app import CALL, encode, new_session, openai_client, trajectory

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def agents_sdk():
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (uv sync --group harness)")
    agents.set_tracing_disabled(True)
    return agents


@pytest.mark.parametrize("model_kind", ["responses", "chat_completions"])
async def test_openai_agents_sdk_with_a_function_tool(client, fake_engine, tokenizer, model_kind):
    agents = agents_sdk()

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """a + b"""
        return a + b

    session = await new_session(client)
    sdk = openai_client(client, session)
    model_class = (
        agents.OpenAIResponsesModel if model_kind == "responses" else agents.OpenAIChatCompletionsModel
    )
    agent = agents.Agent(
        name="calculator",
        instructions="use tools",
        tools=[add],
        model=model_class(model="tiny", openai_client=sdk),
    )
    sampled = encode(tokenizer, CALL) + [tokenizer.eos_token_id]
    answer = encode(tokenizer, "5") + [tokenizer.eos_token_id]
    fake_engine.script = [sampled, answer]
    result = await agents.Runner.run(agent, "2+3?")
    assert result.final_output == "5"
    (segment,) = (await trajectory(client, session)).segments
    assert segment.token_ids == fake_engine.prompts[1] + answer
    assert (
        fake_engine.prompts[1][: len(fake_engine.prompts[0]) + len(sampled)]
        == fake_engine.prompts[0] + sampled
    )
    assert "5" in tokenizer.decode(fake_engine.prompts[1][len(fake_engine.prompts[0]) + len(sampled) :])


async def test_langchain_bind_tools_with_a_tool_call_history(client, fake_engine, tokenizer):
    pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (uv sync --group harness)"
    )
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    session = await new_session(client)
    llm = ChatOpenAI(model="tiny", base_url=session["base_url"], api_key="unused", http_async_client=client)

    def add(a: int, b: int) -> int:
        """a + b"""
        return a + b

    sampled = encode(tokenizer, CALL) + [tokenizer.eos_token_id]
    answer = encode(tokenizer, "5") + [tokenizer.eos_token_id]
    fake_engine.script = [sampled, answer]
    bound = llm.bind_tools([add])
    history = [HumanMessage("2+3?")]
    first = await bound.ainvoke(history)
    (call,) = first.tool_calls
    assert (call["name"], call["args"]) == ("add", {"a": 2, "b": 3})
    history += [first, ToolMessage(str(add(**call["args"])), tool_call_id=call["id"])]
    second = await bound.ainvoke(history)
    assert second.content == "5"
    (segment,) = (await trajectory(client, session)).segments
    assert segment.token_ids == fake_engine.prompts[1] + answer
    assert (
        fake_engine.prompts[1][: len(fake_engine.prompts[0]) + len(sampled)]
        == fake_engine.prompts[0] + sampled
    )


@pytest.mark.parametrize("model_kind", ["chat", "responses"])
async def test_pydantic_ai_agent_with_a_tool(client, fake_engine, tokenizer, model_kind):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed (uv sync --group harness)")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    session = await new_session(client)
    provider = OpenAIProvider(openai_client=openai_client(client, session))
    model_class = OpenAIChatModel if model_kind == "chat" else OpenAIResponsesModel
    agent = Agent(model_class("tiny", provider=provider), instructions="use tools")

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """a + b"""
        return a + b

    sampled = encode(tokenizer, CALL) + [tokenizer.eos_token_id]
    answer = encode(tokenizer, "5") + [tokenizer.eos_token_id]
    fake_engine.script = [sampled, answer]
    result = await agent.run("2+3?")
    assert result.output == "5"
    (segment,) = (await trajectory(client, session)).segments
    assert segment.token_ids == fake_engine.prompts[1] + answer
    assert (
        fake_engine.prompts[1][: len(fake_engine.prompts[0]) + len(sampled)]
        == fake_engine.prompts[0] + sampled
    )
