"""The harness molt gives every verifiers agent: it calls the endpoint verifiers hands it, offline.

verifiers' bundled harnesses run their chat program through `uv sync --script`, which fetches from PyPI on
every rollout. Here a plain chat (no tool servers) is one request made in this process; with tool servers
(MCP) verifiers' own chat program runs under this interpreter, whose environment already holds its
dependencies (openai, mcp). Either way every model call goes through the endpoint, so verifiers records
the trace and molt's tito captures the tokens.
"""

from __future__ import annotations

import json
import sys
import uuid

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult

__all__ = ["MoltHarness"]


class MoltHarness(NullHarness):
    async def setup(self, runtime) -> None:
        """Nothing to install: the chat runs in process or under this interpreter."""

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        if mcp_urls:
            return await self._chat_program(ctx, runtime, endpoint, secret, mcp_urls, system, prompt, trace)
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(message) for message in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")

    async def _chat_program(self, ctx, runtime, endpoint, secret, mcp_urls, system, prompt, trace):
        servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        script = f".molt-chat-{uuid.uuid4().hex}.py"
        await runtime.write(script, CHAT_PROGRAM_SOURCE.encode())
        args = [
            sys.executable,
            script,
            f"--base-url={endpoint}",
            f"--api-key={secret}",
            f"--model={ctx.model}",
            "--mcp-config=" + json.dumps({"mcpServers": servers}),
        ]
        if system:
            args.append(f"--system-prompt={system}")
        if isinstance(prompt, str):
            args.append(f"--prompt={prompt}")
        else:
            path = f".molt-messages-{trace.id}.json"
            await runtime.write(path, json.dumps([message_to_wire(m) for m in prompt or []]).encode())
            args.append(f"--initial-messages-file={path}")
        return await runtime.run_program(args, dict(self.config.resolved_env))
