"""The constraint for a forced tool call (`tito._protocol.forced_tool_call`): whatever the engine samples
inside it is a tool call that parses, so a forced call never comes back as unparsed text."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from tito._protocol import forced_tool_call

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {}, "b": {}}}}}]
PATTERN = forced_tool_call(TOOLS, "add")["regex"]


@settings(max_examples=300, deadline=None)
@given(st.from_regex(re.compile(PATTERN), fullmatch=True))
def test_every_reply_the_constraint_allows_is_a_json_tool_call(reply):
    call = json.loads(reply.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "add" and isinstance(call["arguments"], dict)
