"""The host-time mend for FlashInfer's planning code (minisgl/attention/flashinfer_patches.py):
`tensor_max` gives what builtins.max gives, for tensors and everything else, and once patched
into a module it is what that module's own `max(...)` calls reach. Runs without flashinfer."""

from __future__ import annotations

import builtins
import types

import pytest
import torch

from minisgl.attention.flashinfer_patches import patch_tensor_max, tensor_max


@pytest.mark.parametrize(
    "values",
    [torch.tensor([3, 17, 5, 17, 2], dtype=torch.int32), torch.tensor([1.5, -2.0, 9.25]), torch.tensor([7], dtype=torch.int64)],
)
def test_tensor_max_is_builtins_max_on_1d_tensors(values):
    got, ref = tensor_max(values), builtins.max(values)
    assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == ref.dtype
    assert got.item() == ref.item()


def test_tensor_max_leaves_everything_else_to_builtins():
    assert tensor_max(3, 9, 4) == 9
    assert tensor_max([4, 1, 8]) == 8
    assert tensor_max(x * x for x in (-3, 2)) == 9
    assert tensor_max(["bb", "a"], key=len) == "bb"
    assert tensor_max([], default=-1) == -1
    two_d = torch.tensor([[1, 2], [3, 0]])
    with pytest.raises(RuntimeError):  # builtins.max over rows: an ambiguous tensor comparison
        tensor_max(two_d)
    with pytest.raises(ValueError):  # an empty tensor: builtins' error, not a reduction's
        tensor_max(torch.tensor([], dtype=torch.int32))


def test_patched_module_calls_reach_tensor_max():
    module = types.ModuleType("fake_flashinfer_plan")
    exec("def max_len(lens):\n    return max(lens).item()\n\ndef bigger(a, b):\n    return max(a, b)\n", module.__dict__)
    lens = torch.tensor([12, 900, 31], dtype=torch.int32)
    before = module.max_len(lens)
    patch_tensor_max(module)
    patch_tensor_max(module)  # idempotent
    assert module.max is tensor_max  # type: ignore[attr-defined]
    assert module.max_len(lens) == before == 900
    assert module.bigger(2, 5) == 5
    assert builtins.max is not tensor_max  # nothing outside the module changed
