"""textarena's single-player games as multi-turn Envs: the game's prompt and messages are the user turns,
each reply is one move, and the game's own reward at its end is the rollout's reward.

    molt train --agent.module molt.integrations.textarena:GuessTheNumber-v0 --agent.max_turns 10
    molt train --agent.module 'molt.integrations.textarena:Mastermind-v0,max_turns=8' --agent.max_turns 8

Settings after the game id are passed to the game (its registered arguments, e.g. `max_turns`). The game
runs without textarena's observation wrappers (they restate the whole history each turn; the chat already
holds it) but with its action wrappers (e.g. the brackets some games expect around a move). Give
`--agent.max_turns` at least the game's own turn limit: an episode that molt cuts short scores 0.
`rollout/invalid_move` and `rollout/game_turns` log how episodes ended.

Games that need the network are refused with the reason: word games read NLTK corpora that they download
when imported, and some games play against a hosted model. Multi-player games are refused too.

Seeds: textarena seeds Python's global `random` at reset; each episode here keeps its own copy of that
state (swapped in under a lock for each call), so concurrent episodes and the caller's own `random`
draws do not disturb one another, and a row's seed gives the same game every time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from molt.agent import Env, Result
from molt.integrations import parse_env, require

__all__ = ["load"]

EVAL_SEED_BASE = 2**31
NETWORK_MARKERS = {  # in a game's source: what it fetches
    "nltk": "it downloads NLTK corpora when imported",
    "EnglishDictionary": "its dictionary downloads the NLTK words corpus",
    "OpenRouter": "it plays against a model hosted by OpenRouter",
}
_RANDOM = threading.Lock()  # textarena reseeds the process-wide `random`


def _library():
    return require("textarena", "textarena")


def _needs_network(entry_point) -> str | None:
    """Why a game cannot run offline, read from its package's source (before importing it)."""
    module = entry_point.split(":")[0] if isinstance(entry_point, str) else entry_point.__module__
    package = importlib.util.find_spec(module.rsplit(".", 1)[0])  # imports textarena.envs, not the game
    if package is None:
        return f"its module {module} is missing from the textarena package"
    assert package.submodule_search_locations is not None  # the game's module is in a package
    folder = Path(package.submodule_search_locations[0])
    source = "".join(path.read_text() for path in folder.rglob("*.py"))
    return next((reason for marker, reason in NETWORK_MARKERS.items() if marker in source), None)


def make_game(game: str, settings: dict):
    """The game with its action wrappers and without its observation wrappers (module docstring)."""
    ta = _library()
    spec = ta.envs.registration.ENV_REGISTRY[game]
    env = ta.make(f"{game}-raw") if f"{game}-raw" in ta.envs.registration.ENV_REGISTRY else None
    if env is None or settings:
        entry = spec.entry_point
        if isinstance(entry, str):
            module, name = entry.split(":")
            entry = getattr(importlib.import_module(module), name)
        env = entry(**{**spec.kwargs, **settings})
    for wrapper in spec.default_wrappers or []:
        if issubclass(wrapper, ta.ActionWrapper):
            env = wrapper(env)
    return env


class TextArenaEnv(Env):
    """One game per episode. `game` and `settings` are set by `load`."""

    game: str
    settings: tuple
    state: tuple | None  # `random`'s state inside the game (`_own_random`), set by `reset`

    @contextlib.contextmanager
    def _own_random(self):
        with _RANDOM:
            outer = random.getstate()
            if self.state is not None:
                random.setstate(self.state)
            try:
                yield
            finally:
                self.state = random.getstate()
                random.setstate(outer)

    def _observation(self) -> str:
        _, messages = self.env.get_observation()
        ta = _library()
        return "\n".join(m for _, m, kind in messages if kind != ta.ObservationType.PLAYER_ACTION)

    def reset(self, sample: dict) -> str:
        self.env, self.state = make_game(self.game, dict(self.settings)), None
        with self._own_random():
            self.env.reset(num_players=1, seed=sample["seed"])
            return self._observation()

    def step(self, action: str) -> Result:
        with self._own_random():
            done, _ = self.env.step(action)
            if not done:
                return Result(observation=self._observation())
            rewards, game_info = self.env.close()
        if not rewards or 0 not in rewards or rewards[0] is None:
            raise ValueError(
                f"textarena game {self.game!r} ended without a reward for the player ({rewards})"
            )
        end = game_info.get(0, {})
        info = {
            "invalid_move": float(bool(end.get("invalid_move"))),
            "game_turns": float(end.get("turn_count", 0)),
        }
        return Result(reward=float(rewards[0]), info=info)


def _check(game: str, settings: dict) -> None:
    """Refuse a game that is unknown, needs the network or more than one player, before a run starts."""
    registry = _library().envs.registration.ENV_REGISTRY
    if game not in registry:
        raise ValueError(f"textarena has no game {game!r}; its games: {', '.join(sorted(registry))}")
    reason = _needs_network(registry[game].entry_point)
    if reason:
        raise ValueError(f"textarena game {game!r} cannot run offline: {reason}")
    try:
        env = make_game(game, settings)
    except TypeError as error:
        raise ValueError(f"textarena game {game!r} refused the settings {settings}: {error}") from error
    except Exception as error:  # a broken game (textarena ships one with a syntax error)
        raise ValueError(f"textarena game {game!r} cannot be built: {error!r}") from error
    probe = type("Probe", (TextArenaEnv,), {"game": game, "settings": tuple(sorted(settings.items()))})()
    probe.env, probe.state = env, None
    try:
        with probe._own_random():
            env.reset(num_players=1, seed=0)
    except Exception as error:
        raise ValueError(f"textarena game {game!r} does not start with one player: {error!r}") from error
    if not isinstance(env.state, _library().SinglePlayerState):
        raise ValueError(f"textarena game {game!r} is not a single-player game ({type(env.state).__name__})")


def _rows(base: int) -> Iterator[dict]:
    return ({"seed": base + index} for index in itertools.count())


def load(env: str) -> SimpleNamespace:
    """The agent namespace for `GAME-ID[,key=value...]` (module docstring)."""
    game, settings = parse_env(env)
    _check(game, settings)
    runner = type("AgentRunner", (TextArenaEnv,), {"game": game, "settings": tuple(sorted(settings.items()))})
    return SimpleNamespace(
        AgentRunner=runner,
        dataset=lambda seed: _rows(seed % EVAL_SEED_BASE),
        eval_dataset=lambda seed: _rows(EVAL_SEED_BASE + seed % EVAL_SEED_BASE),
    )
