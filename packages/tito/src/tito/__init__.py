"""tito: token-in/token-out capture of OpenAI and Anthropic chat traffic over vLLM engines."""

from ._chat import ChatRenderer, ChatState, Prompt
from ._engines import EngineNonFinite, EngineUnavailable, ExpansionMismatch, Generation
from ._loopback import serve_on_loop
from ._server import create_app
from ._service import ContextFull, Session, Tito
from ._trajectory import Capture, ImageSpan, Segment, Trajectory, Turn

__all__ = [
    "Capture",
    "ChatRenderer",
    "ChatState",
    "ContextFull",
    "EngineNonFinite",
    "EngineUnavailable",
    "ExpansionMismatch",
    "Generation",
    "ImageSpan",
    "Prompt",
    "Segment",
    "Session",
    "Tito",
    "Trajectory",
    "Turn",
    "create_app",
    "serve_on_loop",
]
