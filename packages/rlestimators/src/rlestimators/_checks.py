"""Input checks shared by every public function: they turn a wrong shape or name into a `ValueError`.

Why a module: each public function must refuse mismatched shapes and empty batches with a message that names
the argument, instead of broadcasting silently or returning NaN. The checks only read shapes and dtypes
(no device synchronisation).

Legend: B sequences, T tokens.
"""

import torch


def check_bt(ref_name: str, ref_BT: torch.Tensor, *, floating: bool = True, **others: torch.Tensor) -> None:
    """Require `ref_BT` to be a non-empty [B, T] tensor and every tensor in `others` to have its shape and,
    unless `floating` is False, a floating dtype (`check_floating`, once every shape has passed)."""
    if ref_BT.dim() != 2:
        raise ValueError(f"{ref_name} must be [B, T] (2-D), got shape {tuple(ref_BT.shape)}")
    if ref_BT.numel() == 0:
        raise ValueError(f"empty batch: {ref_name} has shape {tuple(ref_BT.shape)}; pass at least one token")
    for name, tensor in others.items():
        if tensor.shape != ref_BT.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {ref_name} has {tuple(ref_BT.shape)}; "
                "they must match"
            )
    if floating:
        check_floating(**others)


def check_floating(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def check_groups(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> None:
    """Rewards are a non-empty float [B]; group ids an integer [B] (any values, any order)."""
    if rewards_B.dim() != 1 or rewards_B.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [B], got shape {tuple(rewards_B.shape)}")
    check_floating(rewards=rewards_B)
    if group_ids_B.shape != rewards_B.shape:
        raise ValueError(
            f"group_ids has shape {tuple(group_ids_B.shape)} but rewards has {tuple(rewards_B.shape)}; "
            "pass one group id per reward"
        )
    if group_ids_B.is_floating_point() or group_ids_B.is_complex() or group_ids_B.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor (int64), got {group_ids_B.dtype}")


def check_choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(repr, options))}")
