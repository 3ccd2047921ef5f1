"""The CPU decode step: one flat function over the model's weights instead of the module tree.

On CPU a decode step of a small model is bound by per-op host overhead and by the memory stream
of the weights, not by FLOPs (docs/PERFORMANCE.md, "CPU decode"). So a decode batch on CPU runs
through `CpuDecodeRunner.forward`, which walks the layers with the fewest torch ops we found:

- q/k/v and gate/up are one GEMM each (already merged at load);
- rotary tables are pre-cast to the model dtype, q and k rotate in one op chain;
- attention reads the paged KV pool by slot index (no per-layer cast of every context to fp32);
- optional weight-only int4/int8 GEMMs (`layers/quant.py`) for small batches;
- bf16 GEMMs on the C kernels that read the module's weights in place (kernel/cpu: a VDPBF16PS
  GEMV for <= 8 rows, AMX tiles above), torch's GEMM where the CPU lacks them.

With the C kernels (kernel/cpu) the runner also runs prefill: the same paged attention kernel
takes any number of query rows per request (causal over the cached prefix and the new tokens).
Without a C compiler, decode runs the same step on torch ops (`_forward`) and prefill the
module path. torch.compile of this step was tried and dropped: 4 minutes of inductor compile on
two cores for a slower step (see docs/PERFORMANCE.md).

The arithmetic follows the module path (and so HF): RMSNorm statistics in fp32, scale in the
model dtype; rotary in the model dtype; softmax in fp32. Prefill and anything this runner does
not cover (MoE, tensor parallelism, CUDA) run the model's own forward.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from minisgl.core import Batch
from minisgl.kernel.cpu import SUFFIX, CpuKernels, DecodeGemm, DecodeLayer, DecodeStep, cpu_kernels
from minisgl.kvcache.pool import KVCachePool
from minisgl.layers.quant import DEFAULT_DENSE_ABOVE, QuantLinear, QuantWeight, pack_bf16, vnni_pack, vnni_packable
from minisgl.utils.env import read_env
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

# Decode batches up to this many rows run their layers in one C call (kernel/cpu/decode_loop.c);
# larger ones keep the per-call loop (its Python is small next to their GEMMs).
FUSED_MAX_ROWS = 8


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: QuantLinear
    o: QuantLinear
    gate_up: QuantLinear
    down: QuantLinear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D] in x's dtype (HF's rotate-half layout)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def supports_cpu_decode(model: Any, device: torch.device, tp_size: int) -> str | None:
    """None if the CPU runner can run `model`, else why not."""
    if device.type != "cpu":
        return "not a CPU device"
    if tp_size != 1:
        return "tensor parallelism"
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.is_moe:
        return "MoE model"
    rot = cfg.rotary_config
    if rot.rotary_dim != rot.head_dim:
        return "partial rotary"
    return None


class CpuDecodeRunner:
    def __init__(
        self,
        model: Any,  # a CausalLM: its submodules are read by name
        kv_cache: KVCachePool,
        quant: Dict[str, QuantWeight] | None = None,
        dense_above: int = DEFAULT_DENSE_ABOVE,
    ) -> None:
        cfg = model.config  # type: ignore[attr-defined]
        self.cfg = cfg
        self.kv = kv_cache
        self.eps = cfg.rms_norm_eps
        self.hq, self.hk, self.d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.d**-0.5
        quant = quant or {}
        self.quantized = bool(quant)
        # Opt-in: oneDNN-packed copies of the bf16 GEMM weights, ~30% faster bf16 GEMMs (12.1 vs
        # 17 ms per batch-1 step here) for one more copy of those weights in memory, which the
        # engine's load-memory budget (tests/test_weight_memory.py) does not allow by default.
        pack = read_env().cpu_packed
        self.nthreads = torch.get_num_threads()
        ck = cpu_kernels() if model.model.embed_tokens.weight.dtype == torch.bfloat16 else None  # type: ignore[attr-defined]
        # The C bf16 skinny GEMM for small batches: reads the module's own weights (no copy).
        gemv = ck.lib.gemv_bf16 if ck is not None and ck.has_gemv else None
        amx = ck.lib.gemm_amx_bf16 if ck is not None and ck.has_amx and read_env().cpu_amx else None
        nt = self.nthreads
        self.layers: List[_Layer] = []
        for i, layer in enumerate(model.model.layers):  # type: ignore[attr-defined]
            attn, mlp = layer.self_attn, layer.mlp
            prefix = f"model.layers.{i}."

            def lin(mod: Any, name: str) -> QuantLinear:
                q = quant.get(prefix + name)
                if mod.weight.dim() == 5:  # stored in VNNI tiles (build_cpu_runner): their kernels
                    assert ck is not None and gemv is not None and amx is not None
                    silu = ck.lib.gemm_amx_vnni_silu_bf16 if name == "mlp.gate_up_proj" else None
                    ql = QuantLinear(mod.weight, q, mod.bias, dense_above, None, ck.lib.gemv_vnni_bf16, nthreads=nt,
                                     amx=ck.lib.gemm_amx_vnni_bf16, amx_silu=silu)  # fmt: skip
                    mod.cpu_gemm = ql  # the module path (prompt logprobs) cannot read the tiles itself
                    return ql
                packed = pack_bf16(mod.weight) if pack else None
                return QuantLinear(mod.weight, q, mod.bias, dense_above, packed, gemv, nthreads=nt, amx=amx)

            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    qkv=lin(attn.qkv_proj, "self_attn.qkv_proj"),
                    o=lin(attn.o_proj, "self_attn.o_proj"),
                    gate_up=lin(mlp.gate_up_proj, "mlp.gate_up_proj"),
                    down=lin(mlp.down_proj, "mlp.down_proj"),
                    q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
                    k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
                )
            )
        self.embed = model.model.embed_tokens.weight  # type: ignore[attr-defined]
        self.final_norm = model.model.norm.weight  # type: ignore[attr-defined]
        head = model.lm_head.weight  # type: ignore[attr-defined]
        packed = pack_bf16(head) if pack else None
        self.lm_head = QuantLinear(head, quant.get("lm_head"), None, dense_above, packed, gemv, nthreads=nt, amx=amx)
        # Causal prefill attention on AMX tiles (kernel/cpu/attn_amx.c) for prompts without a cached
        # prefix: 2.4-3.1x SDPA's flash kernel at 100-1000 tokens, 1 thread; SDPA where it declines.
        self._attn_amx = ck.lib.prefill_attention_amx_bf16 if ck is not None and amx is not None else None
        rope = model.model.layers[0].self_attn.attn.rotary  # type: ignore[attr-defined]
        dtype = self.embed.dtype
        self.cos, self.sin = rope.cos.to(dtype), rope.sin.to(dtype)
        self.kernels = None
        if dtype in SUFFIX:
            k = cpu_kernels()
            g = self.hq // self.hk
            if k is not None and self.d <= k.max_head_dim and g <= k.max_group and self.d % 2 == 0:
                self.kernels = k
                self._bind(k, dtype)

    def _bind(self, k: CpuKernels, dtype: torch.dtype) -> None:
        self._rms_fn = k.get("add_rms_norm", dtype)
        self._silu_fn = k.get("silu_mul", dtype)
        self._rope_fn = k.get("rope_store", dtype)
        self._attn_fn = k.get("paged_attention", dtype)
        nul = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        kv = self.kv
        if kv.scales is not None:  # the int8 pool (kv_int8.c): codes and per-head scales
            self._rope_fn, self._attn_fn = k.get("rope_store_q8", dtype), k.get("paged_attention_q8", dtype)
        # per layer: norms, then the pool arguments the rope/store and attention kernels take
        self._ptrs = [
            (L.ln1.data_ptr(), L.ln2.data_ptr(), nul(L.q_norm), nul(L.k_norm), self._pool_args(i))
            for i, L in enumerate(self.layers)
        ]  # fmt: skip
        for t in [L.ln1 for L in self.layers] + [self.final_norm, self.cos, self.sin]:
            assert t.is_contiguous()
        self._fused = self._fused_table(k) if dtype == torch.bfloat16 else None

    def _pool_args(self, layer_id: int) -> Tuple[int, ...]:
        kv = self.kv
        ptrs = (kv.k_cache(layer_id).data_ptr(), kv.v_cache(layer_id).data_ptr())
        if kv.scales is None:
            return ptrs
        return ptrs + (kv.k_scale(layer_id).data_ptr(), kv.v_scale(layer_id).data_ptr())

    def _fused_table(self, k: CpuKernels) -> Any:
        """decode_loop.c's layer table for decode batches of up to `_fused_rows` rows (the most,
        of FUSED_MAX_ROWS, 4, 2, 1, whose GEMMs all have C kernels that take them), or None."""
        for rows in (FUSED_MAX_ROWS, 4, 2, 1):
            specs = [[lin.decode_spec(rows) for lin in (L.qkv, L.o, L.gate_up, L.down)] for L in self.layers]
            if all(sp is not None for row in specs for sp in row):
                break
        else:
            return None
        self._fused_rows = rows
        table = (DecodeLayer * len(self.layers))()
        for entry, ptrs, row in zip(table, self._ptrs, specs):
            entry.ln1, entry.ln2, entry.q_norm, entry.k_norm, pool = ptrs
            entry.k_cache, entry.v_cache = pool[:2]
            if len(pool) == 4:  # int8: the C loop takes the q8 kernels where the scales are set
                entry.k_scale, entry.v_scale = pool[2:]
            for name, sp in zip(("qkv", "o", "gate_up", "down"), row):
                setattr(entry, name, DecodeGemm(*sp))  # type: ignore[misc]
        self._step = DecodeStep(cos=self.cos.data_ptr(), sin=self.sin.data_ptr(), final_norm=self.final_norm.data_ptr(),
                                hidden=self.embed.shape[1], inter=self.layers[0].gate_up.out_features // 2,
                                hq=self.hq, hk=self.hk, d=self.d, eps=self.eps, scale=self.scale, nthreads=self.nthreads)  # fmt: skip
        self._decode_layers = k.lib.decode_layers_bf16
        return table

    # ---- per-step metadata ----------------------------------------------------------------
    def _metadata(self, batch: Batch, page_table: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor | None]:
        reqs = batch.padded_reqs
        lens = [r.device_len for r in reqs]
        max_len = max(lens)
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
        slots = page_table[rows, :max_len].long()
        if min(lens) == max_len:
            return slots, None
        pos = torch.arange(max_len)
        bias = torch.zeros(len(reqs), max_len, dtype=torch.float32)
        bias.masked_fill_(pos[None, :] >= torch.tensor(lens)[:, None], float("-inf"))
        return slots, bias

    def can_run(self, batch: Batch) -> bool:
        """Decode always; prefill too when the C kernels are there (same kernels, any length)."""
        return batch.is_decode or self.kernels is not None

    def forward(self, batch: Batch, page_table: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self._forward_kernels(batch, page_table)
        slots, bias = self._metadata(batch, page_table)
        return self._forward(batch.input_ids, batch.positions, batch.out_loc.long(), slots, bias)

    @staticmethod
    def _token_rows(batch: Batch) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per fed token: its page-table row and how many keys it sees (causal, cached prefix
        included); for prefill also the index of each request's last token (the LM head rows)."""
        reqs = batch.padded_reqs
        if batch.is_decode:
            rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
            return rows, torch.tensor([r.device_len for r in reqs], dtype=torch.int64), None
        rows_l: List[int] = []
        lens_l: List[int] = []
        last_l: List[int] = []
        for r in reqs:
            rows_l += [r.table_idx] * r.extend_len
            lens_l += range(r.cached_len + 1, r.device_len + 1)
            last_l.append(len(lens_l) - 1)
        return (torch.tensor(rows_l, dtype=torch.int64), torch.tensor(lens_l, dtype=torch.int64),
                torch.tensor(last_l, dtype=torch.int64))  # fmt: skip

    @staticmethod
    def _sdpa_plan(batch: Batch) -> List[Tuple[int, int, int, int, int]] | None:
        """(start, length, cached_len, device_len, table row) per request of a prefill.

        Prefill attends through torch's SDPA, not the paged kernel (tuned for one query row per
        request): 4-D bf16 inputs with enable_gqa take oneDNN's flash kernel, 1.0 ms per layer
        for a 500-token prompt against 14 ms for the paged kernel (3-D inputs or repeated KV
        heads fall back to the math path, ~9 ms)."""
        if batch.is_decode:
            return None
        plan, start = [], 0
        for r in batch.padded_reqs:
            plan.append((start, r.extend_len, r.cached_len, r.device_len, r.table_idx))
            start += r.extend_len
        return plan

    def _prefill_sdpa(self, qkv: torch.Tensor, out: torch.Tensor, layer_id: int, page_table: torch.Tensor,
                      plan: List[Tuple[int, int, int, int, int]]) -> None:  # fmt: skip
        hq, hk, d = self.hq, self.hk, self.d
        qs, ks = hq * d, hk * d
        for start, n, cached, total, row in plan:
            rows = qkv[start : start + n]
            if cached == 0 and self._attn_amx is not None:
                o_rows = out[start : start + n]
                if self._attn_amx(rows.data_ptr(), qkv.stride(0), n, hq, hk, d, self.scale, o_rows.data_ptr(),
                                  out.stride(0), self.nthreads):  # fmt: skip
                    continue
            q = rows[:, :qs].view(n, hq, d).transpose(0, 1).unsqueeze(0)
            if cached == 0:  # keys are this step's own rows (as the pool holds them): causal, no gather
                k = rows[:, qs : qs + ks].view(n, hk, d)
                v = rows[:, qs + ks :].view(n, hk, d)
                mask = None
            else:  # a cached prefix: all keys from the pool (this step's are stored already)
                slots = page_table[row, :total].long()
                k, v = self.kv.gather(layer_id, slots, rows.dtype)
                pos = torch.arange(cached, total)
                mask = torch.arange(total)[None, :] <= pos[:, None]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out[start : start + n] = o[0].transpose(0, 1).reshape(n, qs)

    def _forward_kernels(self, batch: Batch, page_table: torch.Tensor) -> torch.Tensor:
        """The step on the fused C kernels: 9 calls per layer (4 GEMMs, 5 kernels), 8 where gate_up
        and SiLU run as one pass (VNNI weights, the row counts the AMX GEMM takes)."""
        b = batch.input_ids.shape[0]  # tokens fed (one per request in decode)
        hq, hk, d, eps = self.hq, self.hk, self.d, self.eps
        table_row, kv_len, last = self._token_rows(batch)
        sdpa_plan = self._sdpa_plan(batch)
        positions = batch.positions if batch.positions.dtype == torch.int32 else batch.positions.int()
        out_loc = batch.out_loc.long()
        assert page_table.dtype == torch.int32 and page_table.is_contiguous()
        x = F.embedding(batch.input_ids, self.embed)
        hidden = x.shape[1]
        res, h = torch.empty_like(x), torch.empty_like(x)
        attn = x.new_empty(b, hq * d)
        inter = self.layers[0].gate_up.out_features // 2
        act = x.new_empty(b, inter)
        rms, rope, attend = self._rms_fn, self._rope_fn, self._attn_fn
        pres, ph, pattn = res.data_ptr(), h.data_ptr(), attn.data_ptr()
        ppos, ploc = positions.data_ptr(), out_loc.data_ptr()
        pcos, psin = self.cos.data_ptr(), self.sin.data_ptr()
        ppt, pt_stride = page_table.data_ptr(), page_table.stride(0)
        prow, plen = table_row.data_ptr(), kv_len.data_ptr()
        width = (hq + 2 * hk) * d
        nt, scale = self.nthreads, self.scale
        esz = x.element_size()
        segments = _attention_segments(sdpa_plan) if sdpa_plan is not None else []
        rms(x.data_ptr(), pres, self._ptrs[0][0], ph, b, hidden, eps, 0)
        n = len(self.layers)
        if self._fused is not None and sdpa_plan is None and b <= self._fused_rows:
            self._run_fused(h, res, attn, act, positions, out_loc, page_table, table_row, kv_len)
            return self.lm_head(h)
        for i, L in enumerate(self.layers):
            _, ln2, qn, kn, pool = self._ptrs[i]
            qkv = L.qkv(h)
            pq = qkv.data_ptr()
            rope(pq, ppos, pcos, psin, qn, kn, eps, *pool, ploc, b, hq, hk, d)
            if i == n - 1 and last is not None and last.numel() < b:
                # past the last layer's K/V store only the LM head's rows matter
                return self.lm_head(self._last_layer_rows(L, qkv, res, last, table_row, kv_len, page_table, pool))
            if sdpa_plan is None:
                attend(pq, width, *pool, ppt, pt_stride, prow, plen, pattn, b, hq, hk, d, scale, nt)
            else:
                for paged, start, count, plan in segments:
                    if paged:  # decode rows and small chunks: the paged kernel, keys read in place
                        attend(pq + start * width * esz, width, *pool, ppt, pt_stride, prow + 8 * start, plen + 8 * start,
                               pattn + start * hq * d * esz, count, hq, hk, d, scale, nt)  # fmt: skip
                    else:
                        self._prefill_sdpa(qkv, attn, i, page_table, plan)
            # (each GEMM result is bound to a name: a temporary would be freed before the call)
            a = L.o(attn)
            rms(a.data_ptr(), pres, ln2, ph, b, hidden, eps, 1)
            self._mlp_act(L, h, act)
            m = L.down(act)
            nxt = self._ptrs[i + 1][0] if i + 1 < n else self.final_norm.data_ptr()
            rms(m.data_ptr(), pres, nxt, ph, b, hidden, eps, 1)
        return self.lm_head(h if last is None else h[last])

    def _mlp_act(self, L: _Layer, h: torch.Tensor, act: torch.Tensor) -> None:
        """act = silu(gate) * up of the MLP input h: gate_up and SiLU in one pass over the VNNI
        tiles where the AMX GEMM runs (the gate_up rows, 2 x inter wide, are never written; the
        same bits as the two steps), else gate_up then silu_mul."""
        if L.gate_up.silu_into(h, act):
            return
        gu = L.gate_up(h)
        self._silu_fn(gu.data_ptr(), act.data_ptr(), h.shape[0], act.shape[1])

    def _last_layer_rows(self, L: _Layer, qkv: torch.Tensor, res: torch.Tensor, last: torch.Tensor,
                         table_row: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor,
                         pool: Tuple[int, ...]) -> torch.Tensor:  # fmt: skip
        """The final layer of a prefill after its K/V store, for the rows the LM head reads (each
        request's last fed token): their attention over the pool (the paged kernel, one query
        row per request), o_proj, the MLP and the final norm. The other rows' outputs would be
        discarded; skipping them saves ~1/30 of a 500-token prefill of the embedded model."""
        hq, hk, d, eps = self.hq, self.hk, self.d, self.eps
        q = qkv[last]  # [r, width]: the q part is read with the row stride
        rows, lens = table_row[last], kv_len[last]
        r, hidden = q.shape[0], res.shape[1]
        attn = q.new_empty(r, hq * d)
        self._attn_fn(q.data_ptr(), q.stride(0), *pool, page_table.data_ptr(), page_table.stride(0), rows.data_ptr(),
                      lens.data_ptr(), attn.data_ptr(), r, hq, hk, d, self.scale, self.nthreads)  # fmt: skip
        res_r = res[last]
        h = torch.empty_like(res_r)
        a = L.o(attn)
        self._rms_fn(a.data_ptr(), res_r.data_ptr(), L.ln2.data_ptr(), h.data_ptr(), r, hidden, eps, 1)
        act = h.new_empty(r, L.gate_up.out_features // 2)
        self._mlp_act(L, h, act)
        m = L.down(act)
        self._rms_fn(m.data_ptr(), res_r.data_ptr(), self.final_norm.data_ptr(), h.data_ptr(), r, hidden, eps, 1)
        return h

    def _run_fused(self, h: torch.Tensor, res: torch.Tensor, attn: torch.Tensor, act: torch.Tensor,
                   positions: torch.Tensor, out_loc: torch.Tensor, page_table: torch.Tensor,
                   table_row: torch.Tensor, kv_len: torch.Tensor) -> None:  # fmt: skip
        """The layers of a small decode batch in one C call (the same kernels in the same order
        as the loop in _forward_kernels: bitwise the same result). h: layer 0's normed input in,
        the final norm's output out."""
        b, hidden = h.shape
        qkv = h.new_empty(b, (self.hq + 2 * self.hk) * self.d)
        a, m, gu = h.new_empty(b, hidden), h.new_empty(b, hidden), h.new_empty(b, 2 * act.shape[1])
        st = self._step
        st.res, st.h, st.qkv, st.attn, st.a = res.data_ptr(), h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), a.data_ptr()
        st.gu, st.act, st.m = gu.data_ptr(), act.data_ptr(), m.data_ptr()
        st.positions, st.out_loc, st.page_table = positions.data_ptr(), out_loc.data_ptr(), page_table.data_ptr()
        st.table_row, st.kv_len, st.pt_stride, st.rows = table_row.data_ptr(), kv_len.data_ptr(), page_table.stride(0), b
        if not self._decode_layers(self._fused, len(self.layers), ctypes.byref(st)):
            raise RuntimeError("decode_layers_bf16 refused its layer table")

    # ---- the step -----------------------------------------------------------------------------
    def _attend(self, q: torch.Tensor, layer_id: int, slots: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """q [B, Hq, D] over the pool rows `slots` [B, S]; returns [B, Hq * D]."""
        b, s = slots.shape
        g = self.hq // self.hk
        k, v = self.kv.gather(layer_id, slots, q.dtype)  # [B, S, Hk, D] (no cast for a model-dtype pool)
        qg = q.view(b, self.hk, g, self.d)
        # [B, Hk, G, D] x [B, Hk, D, S] -> [B, Hk, G, S], fp32 accumulate
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * self.scale
        if bias is not None:
            scores = scores + bias[:, None, None, :]
        p = torch.softmax(scores, dim=-1).to(v.dtype)
        o = torch.matmul(p, v.permute(0, 2, 1, 3))  # [B, Hk, G, D]
        return o.reshape(b, self.hq * self.d)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
        slots: torch.Tensor, bias: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        hq, hk, d, eps = self.hq, self.hk, self.d, self.eps
        qs, ks = hq * d, hk * d
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        residual = x
        h = _rms(x, self.layers[0].ln1, eps)
        n = len(self.layers)
        for i, L in enumerate(self.layers):
            qkv = L.qkv(h)
            q = qkv[:, :qs].view(-1, hq, d)
            k = qkv[:, qs : qs + ks].view(-1, hk, d)
            v = qkv[:, qs + ks :].view(-1, hk, d)
            if L.q_norm is not None and L.k_norm is not None:
                q, k = _rms(q, L.q_norm, eps), _rms(k, L.k_norm, eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.kv.store_kv(k, v, out_loc, i)
            a = L.o(self._attend(q, i, slots, bias))
            residual = residual + a
            h = _rms(residual, L.ln2, eps)
            gu = L.gate_up(h)
            inter = gu.shape[-1] // 2
            m = L.down(F.silu(gu[:, :inter]) * gu[:, inter:])
            residual = residual + m
            h = _rms(residual, self.layers[i + 1].ln1 if i + 1 < n else self.final_norm, eps)
        return self.lm_head(h)


QUANTIZATIONS = ("none", "gguf", "int4", "int8")


def load_quant_weights(model: Any, method: str, model_path: str | None) -> Dict[str, QuantWeight]:
    """Quantized copies of the decode GEMM weights, keyed by module path ('lm_head' included).

    "gguf": the codes of the GGUF the model came from (Q4_1 -> int4, Q8_0 -> int8, code for code);
    "int4" / "int8": round-to-nearest of the loaded dense weights (any checkpoint). The LM head
    is int8 in every mode (int4 costs the vocabulary distribution too much)."""
    from minisgl.layers.quant import Int8Weight, quantize_weight
    from minisgl.models.gguf_quant import gguf_source, load_gguf_quant

    cfg = model.config  # type: ignore[attr-defined]
    if method == "gguf":
        src = gguf_source(model_path)
        if src is None:
            raise ValueError(f"quantization='gguf' needs a .gguf model (or the embedded default), got {model_path!r}")
        codes = load_gguf_quant(src, cfg.num_qo_heads, cfg.num_kv_heads)
        if not codes:
            raise ValueError(f"{src} has no Q4_1/Q8_0 matrices to run quantized")
        return codes
    out: Dict[str, QuantWeight] = {}
    for name, mod in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            out[name] = quantize_weight(mod.weight, method)  # type: ignore[arg-type]
    out["lm_head"] = Int8Weight.quantize(model.lm_head.weight)  # type: ignore[attr-defined]
    return out


def _advise_huge(buf: torch.Tensor) -> None:
    """Ask Linux (THP in madvise mode) for huge pages under `buf`, before its first write, so its
    pages fault in huge; a no-op where madvise is unavailable."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        huge = 2 << 20
        start = -(-buf.data_ptr() // huge) * huge
        end = (buf.data_ptr() + buf.numel() * buf.element_size()) // huge * huge
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)  # MADV_HUGEPAGE
    except (OSError, AttributeError):
        pass


def _release_freed() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim): a freed weight that came from
    the heap, not its own mapping, would otherwise stay resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _hugepage_pool(kv_cache: KVCachePool) -> None:
    """Re-allocate the KV pool on transparent huge pages.

    Decode attention reads each request's slots, which the allocator scatters over the pool:
    on 4 KiB pages nearly every 128-byte key row costs a TLB miss (measured, with the kernel's
    prefetching already in: a 64-request decode step's attention 40 -> 36 ms)."""
    if kv_cache.nbytes < (64 << 20):
        return
    for name in ("buffer", "scales"):  # (an int8 pool's scales are read per key as well)
        old = getattr(kv_cache, name)
        if old is None:
            continue
        shape, dtype = old.shape, old.dtype
        del old
        setattr(kv_cache, name, torch.empty(0, dtype=dtype))  # free the old one first: no 2x peak
        buf = torch.empty(shape, dtype=dtype)
        _advise_huge(buf)
        setattr(kv_cache, name, buf.zero_())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


class _HugeArena:
    """One buffer advised for transparent huge pages, handed out as 64-byte-aligned copies."""

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes + (2 << 20), dtype=torch.uint8)
        _advise_huge(self.buf)
        self.off = -self.buf.data_ptr() % 64

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        view = self.buf[self.off : self.off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        self.off += _aligned(nbytes)
        return view


_PROJECTIONS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def _place_weights(model: Any, vnni: bool) -> None:
    """Move the bf16 GEMM weights the runner streams (the layers' projections, the LM head) onto
    transparent huge pages, for the TLB reason of _hugepage_records; with `vnni` the projections
    land in the AMX tile layout (layers/quant.py vnni_pack), which the C GEMMs read in place
    instead of re-packing the plain weight on every call. One weight at a time: each old storage
    is freed (and handed back) as its copy lands, so memory peaks at one weight above 1x."""
    groups: Dict[int, List[Tuple[str, torch.nn.Parameter]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.endswith(("proj.weight", "lm_head.weight", "embed_tokens.weight")) and p.dim() == 2:
            # a tied head is a second parameter on the embedding's storage: both move together
            group = groups.setdefault(p.data_ptr(), [])
            if all(q is not p for _, q in group):
                group.append((name, p))

    def placed(name: str, t: torch.Tensor) -> torch.Tensor:
        return vnni_pack(t) if vnni and name.endswith(_PROJECTIONS) and vnni_packable(t) else t

    total = sum(_aligned(g[0][1].numel() * g[0][1].element_size()) for g in groups.values())
    arena = _HugeArena(total) if total >= (16 << 20) else None
    for group in groups.values():
        name, first = group[0]
        t = placed(name, first.data)
        view = arena.copy(t) if arena is not None else t
        for _, p in group:
            p.data = view
        del t
        _release_freed()


def _hugepage_records(quant: Dict[str, QuantWeight]) -> None:
    """Move the quantized weights' records onto transparent huge pages: a batch-1 step streams
    all of them (~100 MB), and on 4 KiB pages every 4 KiB of the stream is a TLB miss, which
    also stalls the kernel's software prefetches."""
    unique = list({id(q): q for q in quant.values()}.values())  # a tied head is listed twice
    total = sum(_aligned(q.records.numel()) for q in unique)
    if total < (16 << 20):
        return
    arena = _HugeArena(total)
    for q in unique:
        q.records = arena.copy(q.records)
    _release_freed()


def build_cpu_runner(model: Any, kv_cache: KVCachePool, device: torch.device, config) -> CpuDecodeRunner | None:  # type: ignore[no-untyped-def]
    """The runner for `config`, or None where the module path runs decode (CUDA, TP, MoE, off).
    Quantization where the runner cannot run is an error, not a silent no-op."""
    method = (config.quantization or "none").lower()
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {config.quantization!r}; supported: {', '.join(QUANTIZATIONS)}")
    why_not = supports_cpu_decode(model, device, config.tp_info.size)
    if why_not is None and not config.cpu_fast_decode:
        why_not = "cpu_fast_decode=False"
    if why_not is None and not read_env().cpu_fast_decode:
        why_not = "MINISGL_CPU_FAST_DECODE=0"  # for processes started without a config knob (server)
    if why_not is not None:
        if method != "none":
            raise ValueError(f"quantization={method!r} runs on the CPU decode path only, unavailable here: {why_not}")
        return None
    _hugepage_pool(kv_cache)
    quant = None
    if method != "none":  # (from the plain weights, before they move)
        quant = load_quant_weights(model, method, config.model_path)
        _hugepage_records(quant)
        logger.info_rank0(f"CPU decode: {len(quant)} {method} weight matrices for batches <= {DEFAULT_DENSE_ABOVE}")
    _place_weights(model, vnni=_use_vnni(model))
    return CpuDecodeRunner(model, kv_cache, quant=quant)


def _use_vnni(model: Any) -> bool:
    """The projections go into VNNI tiles where the C kernels that read them are there (AMX and
    AVX512-BF16, a bf16 model) and nothing asked for another layout (oneDNN's packed copies,
    MINISGL_CPU_AMX=0 / MINISGL_CPU_VNNI=0)."""
    env = read_env()
    if model.model.embed_tokens.weight.dtype != torch.bfloat16 or env.cpu_packed or not env.cpu_amx or not env.cpu_vnni:
        return False
    ck = cpu_kernels()
    return ck is not None and ck.has_amx and ck.has_gemv


# A request feeding at most this many tokens (a decode row of a mixed batch, a small prefill
# chunk) attends through the paged kernel, which reads its cached keys in place; SDPA would
# gather and cast its whole prefix in every layer first (a 16-token chunk over a 1,500-token
# prefix: ~0.8 ms per layer of gather for ~0.1 ms of attention).
PAGED_MAX_EXTEND = 32


def _attention_segments(
    plan: List[Tuple[int, int, int, int, int]],
) -> List[Tuple[bool, int, int, List[Tuple[int, int, int, int, int]]]]:
    """A prefill plan as (paged, first token, tokens, sdpa plan) runs: consecutive small
    requests share one paged-kernel call, each large one takes SDPA."""
    out: List[Tuple[bool, int, int, List[Tuple[int, int, int, int, int]]]] = []
    for entry in plan:
        start, n = entry[0], entry[1]
        if n <= PAGED_MAX_EXTEND:
            if out and out[-1][0] and out[-1][1] + out[-1][2] == start:
                out[-1] = (True, out[-1][1], out[-1][2] + n, [])
            else:
                out.append((True, start, n, []))
        else:
            out.append((False, start, n, [entry]))
    return out
