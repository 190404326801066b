"""What refit sends vLLM's own NCCL backend (GPU only to run) fits vLLM's dataclasses for it: checked here
on the CPU build, which ships the same Python."""

from __future__ import annotations

import torch

import refit
from refit._buckets import ParamSpec


def test_nccl_init_and_update_payloads_are_what_vllms_nccl_engine_takes(monkeypatch):
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    engine = refit.Engine("http://127.0.0.1:1", backend=refit.NCCL_BACKEND)
    sent = {}
    monkeypatch.setattr(engine, "world_size", lambda: 2)
    monkeypatch.setattr(
        refit._engine, "_rendezvous", lambda _opener, init: sent.update(init.keywords["json"])
    )
    engine.connect(bucket_bytes=1 << 20)
    init = NCCLWeightTransferInitInfo(**sent["init_info"])
    assert (init.rank_offset, init.world_size) == (1, 3)

    specs = [ParamSpec("w", torch.bfloat16, (4, 2)), ParamSpec("b", torch.float32, (4,))]
    update = NCCLWeightTransferUpdateInfo(**engine.update_info(specs, 2 << 20))
    assert update.packed and update.packed_buffer_size_bytes == 2 << 20
    assert (update.names, update.dtype_names, update.shapes) == (
        ["w", "b"],
        ["bfloat16", "float32"],
        [[4, 2], [4]],
    )
    engine.close()
