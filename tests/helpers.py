"""Shared test helpers: tiny random HF checkpoints, the HF oracle, a manual Engine driver
(the seed's prefill/decode loop, standing in for the scheduler) and tie-aware comparison.

Everything runs in float32 so that the engine can be compared with Hugging Face exactly.
`MINISGL_TEST_DEVICE` (default "cpu") picks the device of both the engine and the HF oracle;
`MINISGL_TEST_ATTENTION_BACKEND` (default "auto") the engine's attention backend.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineConfig

TEST_DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")
TEST_ATTENTION_BACKEND = os.environ.get("MINISGL_TEST_ATTENTION_BACKEND", "auto")
DTYPE = torch.float32
LOGIT_ATOL = 1e-4  # max |ours - HF| on float32 logits
TIE_EPS = 1e-4  # a divergence is only forgiven where HF's own top-2 gap is below this

# ---------------------------------------------------------------------------------------------
# Tiny random checkpoints
# ---------------------------------------------------------------------------------------------

_COMMON: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # the default 0.02 makes a 3-layer model repeat one token whatever the prompt
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,  # no EOS: HF generate runs the full length, like the engine's manual loop
    pad_token_id=None,
)

# name -> (HF model_type, config overrides). "llama_v4" is rewritten after saving into the
# transformers-4 config layout (top-level rope_theta + llama3 rope_scaling, torch_dtype).
TINY_ARCHS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "llama": ("llama", dict(attention_bias=True)),  # bias on q/k/v/o
    "llama_v4": ("llama", dict()),
    "qwen2": ("qwen2", dict()),  # bias on q/k/v only
    "qwen3": ("qwen3", dict(head_dim=32, attention_bias=True, tie_word_embeddings=True)),  # q/k norm, tied head
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            moe_intermediate_size=48,
            mlp_only_layers=[1],  # layers 0 and 2 sparse, layer 1 dense
        ),
    ),
    "mistral": ("mistral", dict(num_attention_heads=8, head_dim=8, num_key_value_heads=2)),  # 4 q heads per kv head
}

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small enough that the short test prompts reach every branch (kept, smoothed, scaled)
    "original_max_position_embeddings": 32,
}
LLAMA_V4_ROPE_THETA = 5000.0


def build_tiny_model(name: str, out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **extra: Any) -> Path:
    """Build a random HF model of architecture `name` (a key of TINY_ARCHS), save it to `out_dir`.
    `extra` overrides config fields on top of the architecture's (e.g. num_key_value_heads=1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = TINY_ARCHS[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **overrides, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):  # HF zero-inits biases: give them values that matter
                p.normal_(0.0, 0.5)
            elif "norm" in pname:  # HF inits norms to ones: make a mis-loaded norm visible
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(out_dir)
    if name == "llama_v4":
        to_transformers4_layout(out_dir, LLAMA_V4_ROPE_THETA, LLAMA3_ROPE_SCALING)
    return out_dir


def to_transformers4_layout(model_dir: Path, rope_theta: float, rope_scaling: Dict[str, Any] | None) -> None:
    """Rewrite config.json the way transformers 4.x wrote it: top-level rope_theta/rope_scaling
    and torch_dtype instead of rope_parameters and dtype."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = rope_theta
    cfg["rope_scaling"] = rope_scaling
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(cfg, indent=2))


def random_prompts(lengths: Sequence[int], seed: int, vocab_size: int = 256) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------
# The HF oracle
# ---------------------------------------------------------------------------------------------


class HFOracle:
    """Hugging Face transformers on the same folder, device and dtype: the expected values."""

    def __init__(self, model_dir: str | Path, device: str = TEST_DEVICE) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPE).to(self.device).eval()
        self._greedy: Dict[Tuple[Tuple[int, ...], int], Tuple[List[int], List[torch.Tensor]]] = {}

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), vocab] logits of every position (float32, on the host)."""
        x = torch.tensor([list(ids)], device=self.device)
        return self.model(input_ids=x).logits[0].float().cpu()

    @torch.inference_mode()
    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> Tuple[List[int], List[torch.Tensor]]:
        """HF generate(do_sample=False) on one unpadded prompt: (tokens, the logits behind each).

        HF stops at the model's EOS (if it has one), so fewer tokens may come back. Memoized per
        prompt and length: every path a test runs compares with the same HF output, computed once."""
        key = (tuple(ids), max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = self._generate(ids, max_new_tokens)
        return self._greedy[key]

    def _generate(self, ids: Sequence[int], max_new_tokens: int) -> Tuple[List[int], List[torch.Tensor]]:
        x = torch.tensor([list(ids)], device=self.device)
        out = self.model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            pad_token_id=self.model.generation_config.pad_token_id or 0,
        )
        tokens = out.sequences[0, len(ids) :].tolist()
        step_logits = [lg[0].float().cpu() for lg in out.logits]
        return tokens, step_logits


def assert_greedy_match(
    ours: Sequence[int],
    ref: Sequence[int],
    ref_step_logits: Sequence[torch.Tensor],
    eos_ids: Sequence[int] = (),
    label: str = "",
) -> int:
    """Token-for-token equality with HF, up to and including HF's first EOS.

    The one allowed escape is a true tie: at the first divergence HF's own logit gap between
    its token and ours is < TIE_EPS; comparison of that sequence stops there.
    Returns how many tokens were compared and found equal."""
    ref = list(ref)
    for i, t in enumerate(ref):
        if t in eos_ids:
            ref = ref[: i + 1]
            break
    assert len(ours) >= len(ref), f"{label}: engine produced {len(ours)} tokens, HF {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            lg = ref_step_logits[i]
            gap = abs(float(lg[b]) - float(lg[a]))
            assert gap < TIE_EPS, (
                f"{label}: first divergence at generated token {i}: engine {a}, HF {b}; HF's logit gap "
                f"between them is {gap:.3g} (not a tie)\n  engine: {list(ours)}\n  HF:     {ref}"
            )
            return i
    return len(ref)


# ---------------------------------------------------------------------------------------------
# Engine construction and the manual driver
# ---------------------------------------------------------------------------------------------


def engine_config(
    model_path: str | Path,
    *,
    page_size: int = 1,
    max_running_req: int = 4,
    max_seq_len: int = 128,
    num_pages: int | None = None,
    **kw: Any,
) -> EngineConfig:
    if num_pages is None:
        # room for every row's whole pages, plus slack so allocations need not be contiguous
        num_pages = max_running_req * (-(-max_seq_len // page_size)) + 8
    kw.setdefault("device", TEST_DEVICE)
    kw.setdefault("attention_backend", TEST_ATTENTION_BACKEND)
    return EngineConfig(
        model_path=str(model_path),
        tp_info=DistributedInfo(0, 1),
        dtype=kw.pop("dtype", DTYPE),
        page_size=page_size,
        max_running_req=max_running_req,
        max_seq_len_override=max_seq_len,
        num_page_override=num_pages,
        **kw,
    )


@contextmanager
def running_engine(model_path: str | Path, **kw: Any) -> Iterator[Engine]:
    engine = Engine(engine_config(model_path, **kw))
    try:
        yield engine
    finally:
        engine.shutdown()


class PageAllocator:
    """Hands out whole pages per request row, deliberately out of order, and writes the page
    table the way the scheduler will: entry j of a row is the pool slot of token j."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine = engine
        self.page_size = engine.config.page_size
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(engine.num_pages, generator=gen).tolist()  # dummy page excluded
        # a hybrid pool (a model with sliding layers, kvcache/window.py): each page also gets a
        # window page, out of order too, written into the pool's translation as the runner does
        window_pages = engine.num_window_pages
        self.window_free = [] if window_pages is None else torch.randperm(window_pages, generator=gen).tolist()

    def _pages(self, n: int) -> torch.Tensor:
        assert n <= len(self.free), "test ran out of KV pages"
        pages, self.free = self.free[:n], self.free[n:]
        return torch.tensor(pages, dtype=torch.int64)

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).flatten()

    def allocate(self, row: int, num_tokens: int, share_from: int | None = None, shared_tokens: int = 0) -> None:
        """Give `row` slots for `num_tokens` tokens; its first `shared_tokens` (a whole number of
        pages) reuse the slots of row `share_from`, whose KV is already in the pool."""
        table = self.engine.page_table
        assert shared_tokens % self.page_size == 0, "shared prefixes are whole pages"
        if shared_tokens:
            assert share_from is not None
            table[row, :shared_tokens] = table[share_from, :shared_tokens]
        rest = num_tokens - shared_tokens
        pages = self._pages(-(-rest // self.page_size))
        slots = self._slots(pages)[:rest]
        table[row, shared_tokens:num_tokens] = slots.to(table.device, torch.int32)
        translation = getattr(self.engine.kv_cache, "translation", None)
        if translation is not None:
            assert len(pages) <= len(self.window_free), "test ran out of window KV pages"
            win = torch.tensor(self.window_free[: len(pages)], dtype=torch.int64)
            self.window_free = self.window_free[len(pages) :]
            translation[self._slots(pages).to(translation.device)] = self._slots(win).to(translation.device)


def make_req(
    ids: Sequence[int],
    row: int,
    output_len: int,
    cached_len: int = 0,
    params: SamplingParams | None = None,
) -> Req:
    return Req(
        input_ids=torch.tensor(list(ids), dtype=torch.int32),
        table_idx=row,
        cached_len=cached_len,
        output_len=output_len,
        uid=row,
        sampling_params=params if params is not None else SamplingParams(max_tokens=output_len),
        cache_handle=None,
    )


def allocated_reqs(engine: Engine, prompts: Sequence[Sequence[int]], steps: int) -> List[Req]:
    """One request per prompt (row = its index), with pages for the prompt and `steps` more tokens."""
    alloc = PageAllocator(engine)
    reqs = []
    for row, ids in enumerate(prompts):
        alloc.allocate(row, len(ids) + steps)
        reqs.append(make_req(ids, row, output_len=steps))
    return reqs


def prepare_batch(engine: Engine, reqs: List[Req], phase: str) -> Batch:
    """Fill a Batch the way the scheduler does (the seed's manual loop), then the attention
    metadata. Tokens [cached_len, device_len) of every (padded) request are fed."""
    batch = Batch(reqs=reqs, phase=phase)  # type: ignore[arg-type]
    engine.graph_runner.pad_batch(batch)
    padded = batch.padded_reqs
    dev = engine.device
    batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in padded]).to(dev)
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len, dtype=torch.int32) for r in padded]).to(dev)
    batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len : r.device_len] for r in padded])
    engine.attn_backend.prepare_metadata(batch)
    return batch


def run_generation(engine: Engine, reqs: List[Req], steps: int) -> List[List[int]]:
    """One prefill of all `reqs` together, then `steps - 1` decode steps through
    Engine.forward_batch, sampling with each request's own SamplingParams."""
    outs: List[List[int]] = [[] for _ in reqs]
    phase = "prefill"
    for _ in range(steps):
        batch = prepare_batch(engine, reqs, phase)
        out = engine.forward_batch(batch, engine.sampler.prepare(batch))
        out.copy_done_event.synchronize()
        for i, r in enumerate(reqs):
            tok = out.next_tokens_cpu[i : i + 1]
            r.append_host(tok)
            outs[i].append(int(tok))
        phase = "decode"
    return outs


def model_logits(engine: Engine, batch: Batch) -> torch.Tensor:
    """The model's logits for a prepared batch (one row per request), without sampling."""
    with torch.inference_mode(), engine.ctx.forward_batch(batch):
        logits = engine.model.forward()
    return logits[: batch.size].float().cpu()


def prefill_logits(engine: Engine, reqs: List[Req]) -> torch.Tensor:
    return model_logits(engine, prepare_batch(engine, reqs, "prefill"))


def teacher_forced_logits(engine: Engine, reqs: List[Req], continuations: List[List[int]]) -> List[torch.Tensor]:
    """Prefill, then decode feeding the given continuation tokens (not our own samples):
    the logits at each step, [B, vocab] each; step j predicts continuation token j."""
    steps = len(continuations[0])
    assert all(len(c) == steps for c in continuations)
    out = [prefill_logits(engine, reqs)]
    for j in range(steps - 1):
        for r, cont in zip(reqs, continuations):
            r.complete_one()
            r.append_host(torch.tensor([cont[j]]))
        out.append(model_logits(engine, prepare_batch(engine, reqs, "decode")))
    return out


def record_runners(engine: Any) -> List[tuple]:
    """Wrap each step runner's `run` to log (runner class, batch phase)."""
    log: List[tuple] = []
    for runner in engine.runners:
        run = runner.run

        def logged(batch: Any, run: Any = run, cls: str = type(runner).__name__) -> torch.Tensor:
            log.append((cls, "prefill" if batch.is_prefill else "decode"))
            return run(batch)

        runner.run = logged
    return log


def assert_prefill_logits_match_hf(model_dir: str | Path, hf: "HFOracle", prompts: Sequence[Sequence[int]], label: str) -> None:
    """One prefill of `prompts` (a row each) on the module path: each last-position logit row
    within LOGIT_ATOL of HF's forward, and HF's rows informative (not ~constant)."""
    with running_engine(model_dir) as engine:
        ours = prefill_logits(engine, allocated_reqs(engine, prompts, 1))
    assert ours.shape[0] == len(prompts)
    for i, ids in enumerate(prompts):
        ref = hf.logits(ids)[-1]
        diff = (ours[i] - ref).abs().max().item()
        assert diff < LOGIT_ATOL, f"{label} prompt {i} (len {len(ids)}): max |logit diff| {diff:.3g}"
        assert ref.std() > 0.1
