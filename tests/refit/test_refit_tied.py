"""Refit of a tied-embedding model on the CPU build: the packed lm_head must follow embed_tokens."""

from __future__ import annotations

import pytest
from refit_helpers import load_model, max_logprob_error, weight_set

import refit

pytestmark = pytest.mark.slow


def test_tied_embeddings_refit_matches_transformers(refit_servers, tied_model_dir, tmp_path):
    server = refit_servers.serve(tied_model_dir)
    assert max_logprob_error(server.url, load_model(tied_model_dir)) < 1e-4
    engine = refit.Engine(server.url)
    for seed in (71, 72):
        model = weight_set(tmp_path, seed, tie=True)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        params = refit.full_params(model)
        assert "lm_head.weight" not in [s.name for s in params.specs]  # the checkpoint has none either
        refit.update_weights([engine], params, version=seed, bucket_bytes=64 << 10)
        assert max_logprob_error(server.url, model) < 1e-4
    engine.close()
