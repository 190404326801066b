"""asyncpool: a streaming pool of prompt groups for asynchronous RL rollouts (pure asyncio, no dependencies).

`GroupPool` keeps prompt groups in flight and returns whole groups as they complete; see README.md.
"""

from asyncpool._pool import Group, GroupPool, PoolExhausted, PoolStats, PromptStarved

__all__ = ["Group", "GroupPool", "PoolExhausted", "PoolStats", "PromptStarved"]
