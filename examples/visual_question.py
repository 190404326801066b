"""A two-turn visual question Env: name the colour of a drawn shape, then the shape in a second picture.

Each episode draws two 56 x 56 pictures (a red, green or blue circle or square on black), shows the
first with "what colour", and, after the reply, the second with "what shape" (the observation a step
returns carries the new image). Each answer earns 1 if it is exactly the right word. The policy must
be a vision-language model, e.g. the seeded tiny Qwen2-VL:

uv run python -c "from molt.tiny_vl import build_tiny_vl_model; build_tiny_vl_model('tiny-vl')"
uv run molt train --agent.module examples/visual_question.py --model.path tiny-vl --agent.max_turns 2
"""

from __future__ import annotations

import base64
import io
import random

import numpy as np

from molt import Env, Result

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (40, 40, 230)}
SHAPES = ("circle", "square")
SIZE = 56


def draw(colour: str, shape: str) -> np.ndarray:
    """A SIZE x SIZE RGB picture: the shape, filled with the colour, centred on black."""
    pixels = np.zeros((SIZE, SIZE, 3), np.uint8)
    rows, cols = np.mgrid[:SIZE, :SIZE]
    centre, radius = SIZE / 2 - 0.5, SIZE * 0.3
    if shape == "circle":
        inside = (rows - centre) ** 2 + (cols - centre) ** 2 <= radius**2
    else:
        inside = (abs(rows - centre) <= radius) & (abs(cols - centre) <= radius)
    pixels[inside] = COLOURS[colour]
    return pixels


def image_part(pixels: np.ndarray) -> dict:
    """An OpenAI image content part holding the picture as a PNG data URL."""
    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def question(pixels: np.ndarray, text: str) -> list[dict]:
    return [{"role": "user", "content": [image_part(pixels), {"type": "text", "text": text}]}]


def dataset(seed: int):
    """Endless rows: the two pictures' colours and shapes."""
    rng = random.Random(seed)
    while True:
        yield {
            "colour": rng.choice(list(COLOURS)),
            "shape": rng.choice(SHAPES),
            "next_colour": rng.choice(list(COLOURS)),
            "next_shape": rng.choice(SHAPES),
        }


def exact(reply: str, answer: str) -> float:
    return float(reply.strip().lower() == answer)


class AgentRunner(Env):
    def reset(self, sample: dict) -> list[dict]:
        self.sample, self.turn = sample, 0
        return question(draw(sample["colour"], sample["shape"]), "what colour")

    def step(self, action: str) -> Result:
        self.turn += 1
        if self.turn == 1:
            follow_up = question(draw(self.sample["next_colour"], self.sample["next_shape"]), "what shape")
            return Result(reward=exact(action, self.sample["colour"]), observation=follow_up)
        return Result(reward=exact(action, self.sample["next_shape"]), info={"turns": 2.0})
