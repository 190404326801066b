"""Attached engines (`--vllm.urls`) are probed once they hold the run's weights (`molt._attached`): real
vLLM (CPU build) servers started without one of the flags molt gives its own engines are refused, naming
that flag. The trainer's side is a stand-in: the same model directory scored in this process with
transformers and `shifted_logprobs` (the function the policy actor computes), not a Ray policy group.
"""

from __future__ import annotations

import pytest
import torch

from molt._attached import check_attached_serving
from molt._batch import shifted_logprobs

pytestmark = pytest.mark.slow  # real vLLM servers

MIDDLEWARE = "--middleware refit.vllm_versions.WeightVersions"
PROCESSED = "--logprobs-mode processed_logprobs"


@pytest.fixture(scope="module")
def raw_logprobs_server(tiny_model_dir, tmp_path_factory):
    """refit's flags (version labels), but logprobs before the temperature (the last flag wins)."""
    from molt._engines import engine_extra_args
    from molt.config import Config
    from molt.vllm_server import VLLMServer

    extra = [*engine_extra_args(Config()), "--logprobs-mode", "raw_logprobs"]
    log = tmp_path_factory.mktemp("raw-logprobs") / "server.log"
    with VLLMServer(tiny_model_dir, extra_args=extra, log_path=log) as server:
        yield server


def trainer(model_dir, temperature: float):
    """The trainer's logprobs of a batch's rows, in float32 (a stand-in for `PolicyGroup.logprobs`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def logprobs(batch):
        with torch.no_grad():
            logits_BTV = model(batch.tokens_BT).logits
        return shifted_logprobs(logits_BTV, batch.tokens_BT, temperature=temperature)

    return logprobs


def test_an_engine_without_the_version_middleware_is_refused_naming_it(vllm_server, tiny_model_dir):
    # the session's plain server: processed logprobs, no refit flags
    with pytest.raises(RuntimeError) as refused:
        check_attached_serving([vllm_server.url], trainer(tiny_model_dir, 0.5), version=0, temperature=0.5)
    assert MIDDLEWARE in str(refused.value) and "--logprobs-mode" not in str(refused.value), refused.value


def test_an_engine_with_logprobs_before_the_temperature_is_refused_naming_the_flag(
    raw_logprobs_server, tiny_model_dir
):
    url = raw_logprobs_server.url
    with pytest.raises(RuntimeError) as refused:
        check_attached_serving([url], trainer(tiny_model_dir, 0.5), version=0, temperature=0.5)
    assert PROCESSED in str(refused.value) and MIDDLEWARE not in str(refused.value), refused.value
    # At temperature 1 the two kinds of logprobs are one: the same engine passes, its labels hold.
    check_attached_serving([url], trainer(tiny_model_dir, 1.0), version=0, temperature=1.0)
    with pytest.raises(RuntimeError, match=r"labels its tokens versions \[0\], not 3"):
        check_attached_serving([url], trainer(tiny_model_dir, 1.0), version=3, temperature=1.0)
