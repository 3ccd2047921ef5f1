"""The CPU kernels `--deterministic` keeps (docs/ARCHITECTURE.md, "Deterministic mode"): each one's
output row is the same bits whether the row is computed alone or inside batches of any size
(odd sizes, tile and thread-split boundaries), because its reduction order per row does not
depend on the number of rows. Checked bitwise, kernel by kernel, on random bf16 data; the
end-to-end consequences (batches, chunking, cache, re-scoring) are in tests/test_deterministic.py."""

from __future__ import annotations

from typing import Callable, List

import pytest
import torch
from helpers import TEST_DEVICE

from minisgl.kernel.cpu import cpu_kernels

pytestmark = pytest.mark.skipif(
    TEST_DEVICE != "cpu" or cpu_kernels() is None, reason="the CPU C kernels (a CPU test device and a C compiler)"
)

# batch sizes around the kernels' blockings: 8-row GEMV blocks, 16-row AMX tiles, 32-row pairs,
# the OpenMP thresholds of the row-wise ops (64 rows)
SIZES = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65)
ROWS = 70


def assert_rows_invariant(fn: Callable[[int, int], torch.Tensor], what: str, rows: int = ROWS) -> None:
    """fn(lo, hi) (the kernel over input rows [lo, hi) only) == fn(0, rows)[lo:hi] bitwise, for
    every size of SIZES at a few offsets."""
    full = fn(0, rows)
    for size in SIZES:
        for lo in sorted({0, 1, rows - size}):
            if lo < 0 or lo + size > rows:
                continue
            part = fn(lo, lo + size)
            assert torch.equal(part, full[lo : lo + size]), f"{what}: rows [{lo}, {lo + size}) differ from the same rows of {rows}"


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _invariant_gemms(n: int, k: int, bias: bool, seed: int) -> List[tuple]:
    """(label, QuantLinear, [n, k] weight) for each batch-invariant configuration this CPU has."""
    from minisgl.layers.quant import ALL_ROWS, QuantLinear, vnni_pack, vnni_packable

    ck = cpu_kernels()
    assert ck is not None
    w = _bf16(n, k, seed=seed, scale=0.1)
    b = _bf16(n, seed=seed + 1) if bias else None
    out = []
    if ck.has_gemv:
        out.append(
            ("skinny GEMM, row-major", QuantLinear(w, None, b, gemv=ck.lib.gemv_bf16, gemv_max_rows=ALL_ROWS, batch_invariant=True), w)
        )
    if ck.has_amx and vnni_packable(w):
        ql = QuantLinear(vnni_pack(w), None, b, gemv_max_rows=0, gemm=ck.lib.gemm_amx_vnni_bf16, batch_invariant=True, nthreads=2)
        out.append(("AMX tiles, VNNI", ql, w))
    return out


@pytest.mark.parametrize("n,k,bias", [(96, 64, True), (50, 80, False), (576, 576, False)])
def test_gemms_rows_do_not_depend_on_the_batch(n: int, k: int, bias: bool) -> None:
    gemms = _invariant_gemms(n, k, bias, seed=n + k)
    if not gemms:
        pytest.skip("this CPU has no batch-invariant C GEMM (AVX512-BF16 / AMX): the mode keeps torch's tiles")
    x = _bf16(ROWS, k, seed=3)
    for label, ql, w in gemms:
        assert_rows_invariant(lambda lo, hi: ql(x[lo:hi].contiguous()), f"{label} {n}x{k}")
        ref = x.float() @ w.float().t() + (ql.bias.float() if ql.bias is not None else 0.0)
        torch.testing.assert_close(ql(x).float(), ref, rtol=2e-2, atol=2e-2)  # and it is the product


def test_fused_gate_up_silu_rows_do_not_depend_on_the_batch() -> None:
    from minisgl.layers.quant import QuantLinear, vnni_pack

    ck = cpu_kernels()
    assert ck is not None
    if not ck.has_amx:
        pytest.skip("no AMX: the fused gate_up + SiLU GEMM runs only on VNNI tiles")
    w = _bf16(256, 64, seed=5, scale=0.1)
    ql = QuantLinear(vnni_pack(w), None, None, gemv_max_rows=0, gemm=ck.lib.gemm_amx_vnni_bf16,
                     amx_silu=ck.lib.gemm_amx_vnni_silu_bf16, batch_invariant=True)  # fmt: skip
    x = _bf16(ROWS, 64, seed=6)

    def fused(lo: int, hi: int) -> torch.Tensor:
        out = ql.silu_and_mul(x[lo:hi].contiguous())
        assert out is not None
        return out

    assert_rows_invariant(fused, "gate_up + SiLU on AMX tiles")


@pytest.mark.parametrize("h", [64, 40])  # 16-lane vector rows / the scalar loop
def test_row_ops_do_not_depend_on_the_batch(h: int) -> None:
    from minisgl.kernel.cpu import ops

    x, res, w = _bf16(ROWS, h, seed=7), _bf16(ROWS, h, seed=8), _bf16(h, seed=9)

    gu = torch.cat([x, res], dim=1)

    def norm(lo: int, hi: int) -> torch.Tensor:
        out = ops.add_rms_norm(x[lo:hi].contiguous(), res[lo:hi].contiguous(), w, 1e-6)
        assert out is not None
        return torch.cat(out, dim=1)

    def silu(lo: int, hi: int) -> torch.Tensor:
        out = ops.silu_and_mul(gu[lo:hi].contiguous())
        assert out is not None
        return out

    assert_rows_invariant(norm, f"add_rms_norm h={h}")
    assert_rows_invariant(silu, f"silu_and_mul h={h}")


@pytest.mark.parametrize("d,hq,hk", [(64, 4, 2), (128, 2, 1), (16, 8, 2)])  # the AVX-512 kernels and the generic loop
def test_paged_attention_rows_do_not_depend_on_the_batch(d: int, hq: int, hk: int) -> None:
    """Query rows of three requests (decode rows and whole prompts: one row per token, attending
    its causal prefix) alone and in batches: the same bits, so a token computed by a decode step
    equals the same token recomputed by a prefill of any chunking."""
    ck = cpu_kernels()
    assert ck is not None
    attend = ck.get("paged_attention", torch.bfloat16)
    slots, width = 400, 160
    k_cache, v_cache = _bf16(slots, hk, d, seed=10), _bf16(slots, hk, d, seed=11)
    g = torch.Generator().manual_seed(12)
    page_table = torch.stack([torch.randperm(slots, generator=g)[:width] for _ in range(3)]).to(torch.int32).contiguous()
    # 70 query rows: request 0 positions 0..39, request 1 positions 100..124, request 2 a few
    # decode rows deep into its prefix (kv_len = position + 1)
    rows = [0] * 40 + [1] * 25 + [2] * 5
    positions = list(range(40)) + list(range(100, 125)) + [7, 150, 63, 64, 159]
    table_row, kv_len = torch.tensor(rows), torch.tensor(positions) + 1
    q = _bf16(len(rows), hq * d, seed=13)

    def run(lo: int, hi: int) -> torch.Tensor:
        n, sel = hi - lo, q[lo:hi].contiguous()
        tr, kl = table_row[lo:hi].contiguous(), kv_len[lo:hi].contiguous()
        out = torch.empty(n, hq * d, dtype=torch.bfloat16)
        attend(sel.data_ptr(), hq * d, k_cache.data_ptr(), v_cache.data_ptr(), page_table.data_ptr(), page_table.stride(0),
               tr.data_ptr(), kl.data_ptr(), out.data_ptr(), n, hq, hk, d, d**-0.5, 2)  # fmt: skip
        return out

    assert_rows_invariant(run, f"paged attention d={d} hq={hq} hk={hk}")
    # and it is attention: row 45 (request 1, position 105) against a float32 softmax
    keys = page_table[1, :106].long()
    kf, vf = k_cache[keys].float(), v_cache[keys].float()  # [106, hk, d]
    qf = q[45].float().view(hk, hq // hk, d)
    p = torch.softmax(torch.einsum("hgd,shd->hgs", qf, kf) * d**-0.5, dim=-1)
    ref = torch.einsum("hgs,shd->hgd", p, vf).reshape(-1)
    torch.testing.assert_close(run(0, ROWS)[45].float(), ref, rtol=2e-2, atol=2e-2)
