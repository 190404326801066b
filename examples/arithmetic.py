"""Generated arithmetic questions, a calculator tool and the reward, shared by the examples.

One dataset serves every agent form: each row has chat `messages` (a system turn and the question), the
`tools` the model may call (OpenAI function schemas) and the expected `answer`. An Env renders the rows
through molt, a ChatAgent sends the same messages and tools through its SDK; either way the engine sees
the same prompt tokens.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Iterator

SYSTEM = "You are a careful calculator. Use the tool when it helps; end with: Answer: NUMBER"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
            "required": ["expression"],
        },
    },
}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def dataset(seed: int, *, tools: bool = True) -> Iterator[dict]:
    """Endless rows `a op b op c`, seeded; each has messages, tools (unless `tools=False`) and answer."""
    rng = random.Random(seed)
    while True:
        a, b, c = (rng.randint(2, 99) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        question = f"{a} {op1} {b} {op2} {c}"
        row = {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {question}?"},
            ],
            "answer": calculate(question),
        }
        yield {**row, "tools": [CALCULATOR]} if tools else row


def calculate(expression: str) -> int:
    """The value of an integer expression; ValueError for anything else (no names, calls or powers)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error


def run_tool(arguments: dict) -> str:
    """The calculator's reply to the model: the value, or what was wrong (a tool error is not a crash)."""
    try:
        return str(calculate(str(arguments.get("expression", ""))))
    except (ValueError, RecursionError) as error:
        return f"error: {error}"


def reward(text: str, answer: int) -> float:
    """1 when the reply's last `Answer: N` is the right number, else 0."""
    found = _ANSWER.findall(text or "")
    return float(bool(found) and int(found[-1]) == answer)
