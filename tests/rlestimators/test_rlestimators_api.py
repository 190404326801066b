"""The public surface of rlestimators: pinned names, name tables that agree with their Literal types, and
a dependency on torch alone."""

import ast
import pathlib
import tomllib
import typing

import pytest
import torch

import rlestimators

PACKAGE_DIR = pathlib.Path(rlestimators.__file__).parent


def test_public_names_are_pinned():
    assert rlestimators.__all__ == [
        "ESTIMATORS",
        "CorrectionMode",
        "EstimatorName",
        "KLKind",
        "PolicyLossKind",
        "dr_grpo",
        "dynamic_filter",
        "entropy_from_logits",
        "gae",
        "grpo",
        "kl",
        "lm_head_logprobs",
        "masked_sum",
        "maxrl",
        "opd",
        "pass_at_k",
        "policy_loss",
        "reinforce",
        "reinforce_pp",
        "rloo",
        "rollout_correction",
        "token_logprobs",
        "value_loss",
    ]
    assert all(hasattr(rlestimators, name) for name in rlestimators.__all__)


def test_estimators_table_matches_estimator_name_literal():
    assert type(rlestimators.ESTIMATORS) is dict
    assert list(rlestimators.ESTIMATORS) == list(typing.get_args(rlestimators.EstimatorName))
    for name, fn in rlestimators.ESTIMATORS.items():
        assert fn is getattr(rlestimators, name)


def _policy(kind):
    logp_BT = torch.zeros(1, 2)
    return rlestimators.policy_loss(
        logp_BT, logp_BT, torch.ones(1), torch.ones(1, 2), kind=kind, clip_low=0.2, clip_high=0.2
    )


def _kl(kind):
    return rlestimators.kl(torch.zeros(1, 2), torch.zeros(1, 2), kind=kind)


def _correction(mode):
    return rlestimators.rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mode=mode)


@pytest.mark.parametrize(
    ("literal", "call"),
    [
        pytest.param(rlestimators.PolicyLossKind, _policy, id="policy_loss-kind"),
        pytest.param(rlestimators.KLKind, _kl, id="kl-kind"),
        pytest.param(rlestimators.CorrectionMode, _correction, id="rollout_correction-mode"),
    ],
)
def test_every_literal_name_is_accepted_and_others_refused(literal, call):
    for name in typing.get_args(literal):
        call(name)
    with pytest.raises(ValueError, match="choose one of"):
        call("not-a-name")


def test_depends_on_torch_alone():
    pyproject = tomllib.loads((PACKAGE_DIR.parents[1] / "pyproject.toml").read_text())
    assert [dep.split(">")[0].split("=")[0] for dep in pyproject["project"]["dependencies"]] == ["torch"]
    imported = set()
    for source in PACKAGE_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
    assert imported <= {"torch", "rlestimators", "typing", "collections"}
