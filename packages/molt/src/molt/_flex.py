"""torch's FlexAttention, compiled once per process: the attention of shared-prefix trees on CUDA
(`molt._prefix.SharedPrefixRows.block_masks` builds the masks, `molt._packing.packed_attention` attends).

Both functions are meant to be compiled (torch's FlexAttention documentation): eager `flex_attention`
materialises the [N, N] scores, and eager `create_block_mask` evaluates the whole [N, N] mask at once
(about 10 N^2 bytes at its peak: 40 GiB for 64k packed tokens). Compiled at import, every layer and every
step call the same compiled functions, which compile once for the first packed length and once more,
with dynamic shapes, for the next (torch.compile's automatic dynamic shapes), then no more. Inside a
decoder layer that `--actor.compile` compiled, `flex_attention` is traced into the layer's graph.

Its own module, imported where a tree is attended to: `torch.compile` imports Dynamo, seconds that the
driver and the CPU actor do not pay. On a CPU (torch 2.11) FlexAttention runs forward only, and its
compiled kernel fails to build for dynamic shapes; the CPU actor attends to trees with SDPA instead.
"""

from __future__ import annotations

import torch
from torch.nn.attention import flex_attention as _flex

flex_attention = torch.compile(_flex.flex_attention)
create_block_mask = torch.compile(_flex.create_block_mask)
