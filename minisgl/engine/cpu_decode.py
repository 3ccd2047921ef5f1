"""The CPU forward's set-up: the GEMMs bound to the model's linear layers, and the whole-step C loop.

On CPU a decode step of a small model is bound by per-op host overhead and by the memory stream
of the weights, not by FLOPs (docs/PERFORMANCE.md, "CPU forward"). The model's one definition
(models/ + layers/) runs on CPU through its ops' CPU implementations: the norms and SiLU on C
kernels (kernel/cpu/ops.py), attention and the K/V store on the paged C kernels (the "cpu"
attention backend, kernel/cpu/attention.py), and every projection on the C GEMM this module
binds to it (`_Linear.cpu_gemm`: a `QuantLinear` over the module's own weight: a VDPBF16PS GEMV
for one row (up to 4 on a CPU without AMX), AMX tiles above, optionally the weight-only int4/int8
records for small batches; on a CPU with AVX2 + FMA but no AVX512-BF16 the same roles run on
skinny_avx2.c's GEMV and records and gemm_avx2.c's GEMM).

A decode batch whose layers the C loop can describe runs them all in one C call instead
(`CpuDecodeLoop`, kernel/cpu/decode_loop.c): the same kernels in the same order on the same
buffers as the module path, so the same bits, without the per-op Python and ctypes overhead. It is
a step runner (engine/runners.py) built once from the model's own modules; a layer it cannot
describe leaves every step to the module path.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from minisgl.core import Batch, get_global_ctx
from minisgl.kernel.cpu import DecodeGemm, DecodeLayer, DecodeStep, cpu_kernels
from minisgl.kernel.cpu.attention import CpuAttnBackend, CpuAttnMetadata
from minisgl.kernel.cpu.memory import hugepage_pool, hugepage_records, place_weights
from minisgl.kvcache.pool import KVCachePool
from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import _Linear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.quant import (
    ALL_ROWS,
    AVX2_GEMV_MAX_ROWS,
    DEFAULT_DENSE_ABOVE,
    DEFAULT_GEMV_MAX_ROWS,
    NO_AMX_GEMV_MAX_ROWS,
    QuantLinear,
    QuantWeight,
)
from minisgl.models.base import DecoderLayer, DecoderModel, GatedMLP, SelfAttention
from minisgl.models.gguf_quant import gguf_source
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

QUANTIZATIONS = ("auto", "none", "gguf", "int4", "int8", "fp8")


def load_quant_weights(model: Any, method: str, model_path: str | None) -> Dict[str, QuantWeight]:
    """Quantized copies of the decode GEMM weights, keyed by module path ('lm_head' included).

    "gguf": the codes of the GGUF the model came from (Q4_1 -> int4, Q8_0 -> int8, code for code);
    "int4" / "int8": round-to-nearest of the loaded dense weights (any checkpoint). The LM head
    is int8 in every mode (int4 costs the vocabulary distribution too much)."""
    from minisgl.layers.quant import Int8Weight, quantize_weight
    from minisgl.models.gguf_quant import load_gguf_quant_cached

    cfg = model.config  # type: ignore[attr-defined]
    if method == "gguf":
        src = gguf_source(model_path)
        if src is None:
            raise ValueError(f"quantization='gguf' needs a .gguf model (or the embedded default), got {model_path!r}")
        from pathlib import Path

        from minisgl.utils.hf import resolve_model_path

        codes = load_gguf_quant_cached(src, cfg.num_qo_heads, cfg.num_kv_heads, Path(resolve_model_path(model_path)))
        if not codes:
            raise ValueError(f"{src} has no Q4_1/Q8_0 matrices to run quantized")
        return codes
    out: Dict[str, QuantWeight] = {}
    for name, mod in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            out[name] = quantize_weight(mod.weight, method)  # type: ignore[arg-type]
    out["lm_head"] = Int8Weight.quantize(model.lm_head.weight)  # type: ignore[attr-defined]
    return out


def checkpoint_int4(model: Any, model_path: str | None) -> Dict[str, QuantWeight]:
    """A 4-bit checkpoint's own codes (AWQ, GPTQ, compressed-tensors; models/weight.py
    load_int4_codes) for the decode GEMMs. Each such layer's dense weight (prefill, larger
    batches) becomes the same Q4_1 values, so every path computes one function: the checkpoint's
    dequantization up to the fp16 rounding of m = -scale * zero (docs/MODELS.md)."""
    from minisgl.models.weight import load_int4_codes
    from minisgl.utils.hf import resolve_model_path

    label, codes = load_int4_codes(model, resolve_model_path(model_path))
    with torch.no_grad():
        for name, q in codes.items():
            w = model.get_submodule(name).weight
            w.copy_(q.dequantize().to(w.dtype))
    if codes:
        logger.info_rank0(
            f"CPU decode: {len(codes)} {label} int4 weight matrices (the checkpoint's codes) for batches <= {DEFAULT_DENSE_ABOVE}"
        )
    return dict(codes)


def _gemm_modules(model: nn.Module) -> List[Tuple[str, Any]]:
    """The modules whose GEMM the CPU path binds: every linear layer and the LM head."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (_Linear, ParallelLMHead))]


def bind_cpu_gemms(model: nn.Module, quant: Dict[str, QuantWeight] | None, batch_invariant: bool = False) -> List[QuantLinear]:
    """Set each linear layer's and the LM head's `cpu_gemm` (tp == 1): the C GEMMs for a bf16
    model, the quantized records where `quant` has them. Where the CPU has AMX and AVX512-BF16
    the projections first move into VNNI tiles (read in place by the AMX / VNNI kernels, and
    gate_up with its SiLU in one pass); the rest stay row-major. Returns the bound GEMMs.

    `batch_invariant` (`--deterministic`): no quantized records, and each weight keeps one kernel
    for every row count (QuantLinear's batch_invariant): the AMX tiles on VNNI tiles, the skinny
    GEMM on a row-major weight; a weight with neither stays unbound (F.linear, which the mode
    runs as fixed-shape tiles: layers/batch_invariant.py)."""
    quant = {} if batch_invariant else quant or {}
    mods = _gemm_modules(model)
    bf16 = all(m.weight.dtype == torch.bfloat16 for _, m in mods)
    ck = cpu_kernels() if bf16 else None
    gemv = ck.lib.gemv_bf16 if ck is not None and ck.has_gemv else None
    # the GEMM of many rows: AMX tiles, else AVX2 FMAs (neither: torch's)
    gemm = ck.lib.gemm_amx_bf16 if ck is not None and ck.has_amx else None
    gemm = ck.lib.gemm_avx2_bf16 if ck is not None and ck.has_avx2_gemm else gemm
    vnni = ck is not None and ck.has_amx and ck.has_gemv
    place_weights(model, [f"{n}.weight" for n, m in mods if vnni and isinstance(m, _Linear)])
    if ck is None and not quant:
        return []  # F.linear is what a QuantLinear would call
    nt = torch.get_num_threads()
    gemv_rows = NO_AMX_GEMV_MAX_ROWS
    if ck is not None:
        gemv_rows = DEFAULT_GEMV_MAX_ROWS if ck.has_amx else AVX2_GEMV_MAX_ROWS if ck.has_avx2_gemm else gemv_rows
    bound: List[QuantLinear] = []
    for name, mod in mods:
        w, bias, q = mod.weight, getattr(mod, "bias", None), quant.get(name)
        if batch_invariant:
            if w.dim() == 5:
                assert ck is not None
                silu = ck.lib.gemm_amx_vnni_silu_bf16 if getattr(mod, "fused_kind", "") == "gated" else None
                ql = QuantLinear(w, None, bias, gemv_max_rows=0, nthreads=nt, gemm=ck.lib.gemm_amx_vnni_bf16, amx_silu=silu,
                                 batch_invariant=True)  # fmt: skip
            elif gemv is not None:
                ql = QuantLinear(w, None, bias, gemv=gemv, gemv_max_rows=ALL_ROWS, nthreads=nt, batch_invariant=True)
            else:
                continue
        elif w.dim() == 5:  # in VNNI tiles: the kernels of that layout
            assert ck is not None
            silu = ck.lib.gemm_amx_vnni_silu_bf16 if getattr(mod, "fused_kind", "") == "gated" else None
            ql = QuantLinear(w, q, bias, DEFAULT_DENSE_ABOVE, ck.lib.gemv_vnni_bf16, nthreads=nt,
                             gemm=ck.lib.gemm_amx_vnni_bf16, amx_silu=silu)  # fmt: skip
        else:
            ql = QuantLinear(w, q, bias, DEFAULT_DENSE_ABOVE, gemv, gemv_rows, nthreads=nt, gemm=gemm)
        mod.cpu_gemm = ql
        bound.append(ql)
    return bound


def bound_gemms(model: nn.Module) -> List[QuantLinear]:
    """The CPU GEMMs bound to `model` (empty where none are)."""
    return [m.cpu_gemm for _, m in _gemm_modules(model) if m.cpu_gemm is not None]


def gemms_batch_invariant(model: nn.Module) -> bool:
    """Whether every linear layer and the LM head runs a batch-invariant C GEMM (then the
    `--deterministic` forward needs no fixed-shape tiles around it)."""
    return all(m.cpu_gemm is not None and m.cpu_gemm.batch_invariant for _, m in _gemm_modules(model))


# ---- the whole-step C loop --------------------------------------------------------------------
def _describe(model: nn.Module, backend: Any, rows: int) -> Tuple[Any, str]:
    """(decode_loop.c's layer table for decode batches of up to `rows` rows, "") where it can
    describe every layer of `model`, else (None, why not). The loop computes exactly
    DecoderLayer(SelfAttention, GatedMLP) over a DecoderModel, so other classes (or subclasses,
    which may override a forward) are what it cannot describe."""
    inner = getattr(model, "model", None)
    if type(inner) is not DecoderModel or not isinstance(getattr(model, "lm_head", None), ParallelLMHead):
        return None, f"{type(model).__name__} is not a DecoderModel + LM head"
    if not isinstance(backend, CpuAttnBackend) or backend.kernels is None:
        return None, "the attention backend is not the CPU kernels'"
    eps = inner.norm.eps
    table = (DecodeLayer * len(inner.layers))()
    shape: Tuple[int, ...] | None = None
    for i, (entry, layer) in enumerate(zip(table, inner.layers)):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer) is not DecoderLayer or type(attn) is not SelfAttention or type(mlp) is not GatedMLP:
            return None, f"layer {i} is {type(layer).__name__}({type(attn).__name__}, {type(mlp).__name__})"
        assert isinstance(layer, DecoderLayer) and isinstance(attn, SelfAttention) and isinstance(mlp, GatedMLP)
        if not layer.plain or not attn.plain:  # post-norms, multipliers, NoPE, wide q/k norm...
            return None, f"layer {i} has options the loop does not compute (DecoderLayer/SelfAttention.plain)"
        assert isinstance(layer.input_layernorm, RMSNorm) and isinstance(layer.post_attention_layernorm, RMSNorm)
        a = attn.attn
        if not backend.takes(a) or a.layer_id != i:
            return None, f"layer {i}'s attention is not one the kernels take"
        norms: List[RMSNorm] = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        if any(n.eps != eps or n.weight.dtype != torch.bfloat16 for n in norms):
            return None, f"layer {i}'s norms differ in eps or dtype"
        gemms = [attn.qkv_proj.cpu_gemm, attn.o_proj.cpu_gemm, mlp.gate_up_proj.cpu_gemm, mlp.down_proj.cpu_gemm]
        specs = [g.decode_spec(rows) if g is not None else None for g in gemms]
        if any(sp is None for sp in specs):
            return None, f"layer {i} has a GEMM without a C kernel for up to {rows} rows"
        this = (a.num_q_heads, a.num_kv_heads, a.head_dim, gemms[2].out_features // 2)  # type: ignore[union-attr]
        if shape is not None and this != shape:
            return None, f"layer {i}'s shape differs from layer 0's"
        shape = this
        entry.ln1, entry.ln2 = layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()
        entry.q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None
        entry.k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None
        pool = backend.pool_args(i)
        entry.k_cache, entry.v_cache = pool[:2]
        if len(pool) == 4:  # int8: the C loop takes the q8 kernels where the scales are set
            entry.k_scale, entry.v_scale = pool[2:]
        for field_name, sp in zip(("qkv", "o", "gate_up", "down"), specs):
            setattr(entry, field_name, DecodeGemm(*sp))  # type: ignore[misc]
    if shape is None or len({id(layer.self_attn.attn.rotary) for layer in inner.layers}) != 1:  # type: ignore[union-attr]
        return None, "no layers, or layers with different rotary tables"
    return table, ""


class CpuDecodeLoop:
    """A bf16 decode step's layer stack in one C call (kernel/cpu/decode_loop.c), as a step runner:
    the embedding, layer 0's input norm and the LM head are the model's own modules around it.
    Up to `rows` fed tokens: decode batches, and prefills whose every request feeds a few tokens
    (speculative verify steps, small mixed steps); larger prefills take the module path."""

    def __init__(self, model: nn.Module, backend: CpuAttnBackend, page_table: torch.Tensor, table: Any,
                 rows: int) -> None:  # fmt: skip
        inner: Any = model.model
        self.model, self.backend, self.page_table, self.table, self.rows = model, backend, page_table, table, rows
        self.nlayers = len(inner.layers)
        layer0 = inner.layers[0]
        attn = layer0.self_attn.attn
        self.embed, self.first_norm = inner.embed_tokens, layer0.input_layernorm
        self.lm_head: Any = model.lm_head
        cos, sin = backend.rope_tables(attn.rotary)
        self.step = DecodeStep(cos=cos.data_ptr(), sin=sin.data_ptr(), final_norm=inner.norm.weight.data_ptr(),
                               hidden=self.embed.weight.shape[1],
                               inter=layer0.mlp.gate_up_proj.cpu_gemm.out_features // 2, hq=attn.num_q_heads,
                               hk=attn.num_kv_heads, d=attn.head_dim, eps=inner.norm.eps, scale=attn.head_dim**-0.5,
                               nthreads=backend.nthreads)  # fmt: skip
        self._decode_layers: Any = backend.kernels.lib.decode_layers_bf16  # type: ignore[union-attr]
        assert page_table.dtype == torch.int32 and page_table.is_contiguous()

    @staticmethod
    def build(model: nn.Module, backend: Any, page_table: torch.Tensor, max_rows: int) -> "CpuDecodeLoop | None":
        """The loop for decode batches of up to the most rows (of max_rows, 8, 4, 2, 1) whose GEMMs
        all have C kernels that take them, or None (why not: logged at debug level)."""
        why = "no row count"
        for rows in sorted({r for r in (max_rows, 8, 4, 2, 1) if r <= max_rows}, reverse=True):
            table, why = _describe(model, backend, rows)
            if table is not None:
                return CpuDecodeLoop(model, backend, page_table, table, rows)
            if "GEMM" not in why:
                break  # (only the GEMMs depend on the row count)
        logger.debug(f"CPU decode loop not built: {why}")
        return None

    def can_run(self, batch: Batch) -> bool:
        meta = batch.attn_metadata
        if batch.return_hidden or not isinstance(meta, CpuAttnMetadata):
            return False
        if batch.is_decode:
            return batch.prompt_logprob_rows is None and batch.padded_size <= self.rows
        # A prefill of short extends (a verify step: each row's last token and its drafts; a
        # mixed step's decode rows and small chunks): every fed token attends through the paged
        # kernel with its own key count, as a decode row does, so the loop computes it exactly
        # as the module path would. A large request's SDPA / AMX attention is the module path's.
        return meta.table_row.numel() <= self.rows and all(seg.plan is None for seg in meta.segments)

    def run(self, batch: Batch) -> torch.Tensor:
        meta = batch.attn_metadata
        assert isinstance(meta, CpuAttnMetadata)
        positions, out_loc = self.backend.step_args(batch)
        h, res = self.first_norm.forward_with_residual(self.embed(batch.input_ids), None)
        b, hidden = h.shape
        st = self.step
        d, hq, hk = st.d, st.hq, st.hk
        # (each buffer is bound to a name for the call: a temporary would be freed before it)
        qkv, attn = h.new_empty(b, (hq + 2 * hk) * d), h.new_empty(b, hq * d)
        a, m, gu, act = h.new_empty(b, hidden), h.new_empty(b, hidden), h.new_empty(b, 2 * st.inter), h.new_empty(b, st.inter)
        st.res, st.h, st.qkv, st.attn, st.a = res.data_ptr(), h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), a.data_ptr()
        st.gu, st.act, st.m = gu.data_ptr(), act.data_ptr(), m.data_ptr()
        st.positions, st.out_loc, st.page_table = positions.data_ptr(), out_loc.data_ptr(), self.page_table.data_ptr()
        st.table_row, st.kv_len = meta.table_row.data_ptr(), meta.kv_len.data_ptr()
        st.pt_stride, st.rows = self.page_table.stride(0), b
        if not self._decode_layers(self.table, self.nlayers, ctypes.byref(st)):
            raise RuntimeError("decode_layers_bf16 refused its layer table")
        if batch.is_prefill:  # (as DecoderForCausalLM.forward: h is the final-normed hidden state)
            if batch.prompt_logprob_rows is not None:  # prompt logprobs or a verify step's rows
                batch.prompt_hidden = h[batch.prompt_logprob_rows]
            h = h[meta.last_indices]
        return self.lm_head(h)


def _gguf_codes_pay(config: Any) -> bool:
    """`auto` on a GGUF: its own codes where the C int4 kernel runs them (bf16 activations, a CPU
    with the kernel built), which is the 2x faster batch-1 step. Elsewhere (float32: the exact
    path; CPUs without AVX512-BF16) torch's int4 fallback would be slower than the dense weights,
    which hold the same values."""
    from minisgl.layers.quant import Int4Weight

    return config.dtype == torch.bfloat16 and gguf_source(config.model_path) is not None and Int4Weight.c_kernel_available()


def build_cpu_runner(model: nn.Module, kv_cache: KVCachePool, device: torch.device, config: Any) -> CpuDecodeLoop | None:
    """Bind the CPU implementations of the model's GEMMs and build the C loop (None where it
    cannot run: then the module path takes every step). Nothing on CUDA, at tp > 1 or with
    `cpu_fast_decode=False`; quantization there is an error, not a silent no-op. The page table
    and attention backend are the engine's, from the global context."""
    method = (config.quantization or "auto").lower()
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {config.quantization!r}; supported: {', '.join(QUANTIZATIONS)}")
    why_not = None
    if device.type != "cpu":
        why_not = "not a CPU device"
    elif config.tp_info.size != 1:
        why_not = "tensor parallelism"
    elif not config.cpu_fast_decode:
        why_not = "cpu_fast_decode=False"
    if why_not is not None:
        # (fp8 is CUDA's, checked at engine config; int4 on CUDA is the W4A16 GEMM, layers/int4.py)
        if method not in ("auto", "none", "fp8") and not (method == "int4" and device.type == "cuda"):
            raise ValueError(f"quantization={method!r} runs on the CPU decode path only, unavailable here: {why_not}")
        return None
    hugepage_pool(kv_cache)
    quant = None
    if config.deterministic:  # (quantization other than auto/none is refused at engine config)
        method = "none"  # the dense weights as loaded, one kernel for every row count
    if method == "auto" and not config.use_dummy_weight and _gguf_codes_pay(config):
        method = "gguf"  # a GGUF runs on its own codes (what a GGUF user expects; none: dequantized)
    if method == "auto":  # (dummy weights: no checkpoint to read codes from)
        quant = None if config.use_dummy_weight else checkpoint_int4(model, config.model_path) or None
    elif method != "none":  # (from the plain weights, before they move)
        quant = load_quant_weights(model, method, config.model_path)
        logger.info_rank0(f"CPU decode: {len(quant)} {method} weight matrices for batches <= {DEFAULT_DENSE_ABOVE}")
    if quant:
        hugepage_records(quant)
    bind_cpu_gemms(model, quant, batch_invariant=config.deterministic)
    ctx = get_global_ctx()
    assert ctx.page_table is not None
    return CpuDecodeLoop.build(model, ctx.attn_backend, ctx.page_table, config.max_running_req)
