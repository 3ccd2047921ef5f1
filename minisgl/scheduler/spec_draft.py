"""The draft model of `--speculative-algorithm draft`: a smaller checkpoint sharing the target's
vocabulary proposes each speculating row's drafts, one forward per draft position for every row.

The draft is a second `Engine` in the process (engine/engine.py, `draft_of`): its own weights,
KV pool, page table and attention backend, built by the same code as the target's, with its own
Context made global only around its build and its forwards (`Engine.activated`); it shares the
target's stream. It runs eagerly (no CUDA graphs) at tp 1.

Its pages are its own (`PageAllocator` over its pool, which has as many pages as the target's:
`memory_reserve` sizes the target's pool for both), one list per request, written into the
draft's page table at the request's table row (the same row index as the target's). A request's
draft KV is the draft's KV of its real tokens up to `cached`; a proposal first feeds the tokens
it lacks (the prompt on the first proposal: the draft prefills lazily, at the request's first
verify step; after that the accepted run and the target's token), then one draft token per
forward. The drafts' own KV stays trusted only as far as the target accepts them (`accepted`:
rolled back to the target's KV length); pages are returned when the request is released
(finished, aborted, retracted). The prefix cache never holds draft pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

import torch

from minisgl.core import Batch, Req
from minisgl.engine.engine import Engine, MemoryReserve
from minisgl.engine.sample import MIN_P, MIN_T, filtered_probs, greedy_tokens
from minisgl.engine.spec_verify import adjusted_logits, make_verify_args
from minisgl.kvcache.allocator import PageAllocator
from minisgl.kvcache.pool import model_kv_bytes_per_slot
from minisgl.layers.rotary import rope_tables
from minisgl.models import create_model
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.spec_proposer import within_grammar
from minisgl.utils.device import make_device_tensor, stream_context
from minisgl.utils.logger import init_logger
from minisgl.utils.misc import div_ceil
from minisgl.utils.torch_utils import torch_dtype

logger = init_logger(__name__)


def draft_config(config: SchedulerConfig) -> SchedulerConfig:
    """The draft engine's config: the target's, with the draft checkpoint, no speculation of its
    own and no CUDA graphs (its steps run eagerly). Refuses a draft whose vocabulary differs."""
    assert config.speculative_draft_model is not None
    draft = dataclasses.replace(
        config, model_path=config.speculative_draft_model, speculative_algorithm=None, speculative_draft_model=None,
        cuda_graph_bs=[], cuda_graph_max_tokens=0, task="generate",
    )  # fmt: skip
    target_vocab, draft_vocab = config.model_config.vocab_size, draft.model_config.vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(
            f"the draft model {config.speculative_draft_model} has a vocabulary of {draft_vocab} tokens, the model "
            f"{config.model_path} one of {target_vocab}: a draft model must share the target's tokenizer"
        )
    return draft


def memory_reserve(config: SchedulerConfig) -> MemoryReserve:
    """The draft's share of the target's memory budget: its weights (summed on a meta-device
    model) and its KV bytes per slot, so the target sizes its pool for both pools."""
    mc = config.model_config
    with rope_tables(torch.device("meta")), torch.device("meta"), torch_dtype(config.dtype):
        model = create_model(mc)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return MemoryReserve(weights, model_kv_bytes_per_slot(mc, config.kv_cache_dtype, config.dtype, 1))


def build_draft_engine(config: SchedulerConfig, target: Engine) -> Engine:
    """The draft engine beside `target`: as many KV pages and as long a context as the target's."""
    longest = config.model_config.rotary_config.max_position
    if target.max_seq_len > longest:
        raise ValueError(
            f"the draft model {config.model_path} takes {longest} positions, fewer than the context of {target.max_seq_len} "
            "tokens served: pass --max-seq-len of at most that"
        )
    draft = dataclasses.replace(config, num_page_override=target.num_pages, max_seq_len_override=target.max_seq_len)
    if target.device.type == "cuda":
        logger.info("speculative draft model %s runs eagerly (no CUDA graphs for draft steps yet)", config.model_path)
    return Engine(draft, draft_of=target)


class _Row:
    """One request's state in the draft model's pool."""

    def __init__(self, uid: int, params: Any) -> None:
        self.pages: List[int] = []
        self.cached = 0  # positions [0, cached) hold the draft's KV of the request's real tokens
        self.end = 0  # ... and [cached, end) its KV of the last drafts (trusted as far as accepted)
        self.q: torch.Tensor | None = None  # a sampled row's last drafts' distributions [k, V]
        # the engine's view of the row in a draft batch (lengths set per forward)
        self.view = Req(input_ids=torch.zeros(1, dtype=torch.int32), table_idx=0, cached_len=0, output_len=1, uid=uid,
                        sampling_params=params, cache_handle=None)  # fmt: skip


class _AtDraft:
    """A request as make_verify_args reads it after some of its drafts: `device_len` counts
    them (the adjustments of the position they lead to: penalties over them, min_tokens)."""

    def __init__(self, req: Any, device_len: int) -> None:
        self._req = req
        self.device_len = device_len

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


class DraftModelProposer:
    """`Proposer` of `--speculative-algorithm draft` over a draft `Engine`."""

    batched = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.device = engine.device
        self.page_size = engine.config.page_size
        self.vocab_size = engine.config.model_config.vocab_size
        self.allocator = PageAllocator(engine.num_pages)
        # tokens per draft forward at most while catching up (the target's prefill chunk size)
        self.max_extend_tokens = int(getattr(engine.config, "max_extend_tokens", 8192))
        self._rows: Dict[int, _Row] = {}
        self.pool_full = 0  # rows that could not draft for want of draft pages (the sizing makes it rare)

    # ---- Proposer ----------------------------------------------------------------------------
    def propose(self, reqs: Sequence[Any], lengths: Sequence[int], grammar: Any) -> List[List[int]]:
        drafts: List[List[int]] = [[] for _ in reqs]
        live: List[Tuple[int, Any, _Row, int]] = []  # (index, request, its state, draft length)
        for i, (req, k) in enumerate(zip(reqs, lengths)):
            if k <= 0:
                continue
            row = self._rows.get(req.uid)
            if row is None:
                row = self._rows[req.uid] = _Row(req.uid, req.sampling_params)
            row.view.table_idx = req.table_idx
            row.q = None
            # KV for every real token and every draft but the last: positions [0, device_len + k - 1)
            if not self._ensure_pages(row, req.table_idx, req.device_len + k - 1):
                self.pool_full += 1
                logger.warning("draft model's KV pool is full: request %d does not draft this step", req.uid)
                continue
            live.append((i, req, row, k))
        if not live:
            return drafts
        with self.engine.activated(), torch.inference_mode():
            logits = self._catch_up([(req, row) for _, req, row, _ in live])
            # Penalties, logit_bias, min_tokens and grammars adjust a draft's logits by the drafts
            # before it, which are read on the host; without them the drafts stay on the device
            # until the last one (one host copy, not one per draft position)
            on_host = any(_adjusts(req) for _, req, _, _ in live)
            qs: List[List[torch.Tensor]] = [[] for _ in live]
            active = list(range(len(live)))
            steps: List[Tuple[List[int], torch.Tensor]] = []  # on the device: (rows, their tokens) per position
            tokens = torch.empty(0)
            for j in range(max(k for *_, k in live)):
                if j > 0:  # feed each row's last draft: the next position's logits
                    feeds = [(live[a][2], live[a][1].device_len + j - 1, 1) for a in active]
                    logits = self._forward(feeds, [drafts[live[a][0]][-1] for a in active] if on_host else tokens.to(torch.int32))
                prefixes = [drafts[live[a][0]] for a in active]  # (on the device path: not read)
                tokens, probs = self._choose([live[a][1] for a in active], prefixes, logits, grammar)
                keep: List[int] = []
                for n, a in enumerate(active):
                    i, req, row, k = live[a]
                    if probs is not None and probs[n] is not None:
                        qs[a].append(probs[n])
                    if j + 1 < k:
                        keep.append(n)
                if on_host:
                    keep = self._append_host(tokens.tolist(), active, live, drafts, qs)
                else:
                    steps.append((active, tokens))
                    tokens = tokens[torch.tensor(keep, dtype=torch.int64, device=tokens.device)] if len(keep) < len(active) else tokens
                active = [active[n] for n in keep]
                if not active:
                    break
            if steps:
                flat = torch.cat([t for _, t in steps]).tolist()
                at = 0
                for rows, _ in steps:
                    for a in rows:
                        drafts[live[a][0]].append(flat[at])
                        at += 1
            for a, (i, req, row, _k) in enumerate(live):
                # KV of the drafts fed: all but the last (a grammar cut's popped one may have been
                # fed too: leaving it out only costs recomputing it)
                row.end = req.device_len + len(drafts[i]) - 1
                row.q = torch.stack(qs[a]) if qs[a] else None
        return drafts

    @staticmethod
    def _append_host(
        tokens: List[int], active: List[int], live: List[Tuple[int, Any, _Row, int]], drafts: List[List[int]], qs: List[List[torch.Tensor]]
    ) -> List[int]:
        """The host path: append each active row's new draft; a grammar row whose draft runs
        past the grammar's end stops (the token and its q row dropped). The rows (indices into
        `active`) that draft on."""
        keep: List[int] = []
        for n, a in enumerate(active):
            i, req, _, k = live[a]
            drafts[i].append(tokens[n])
            if req.grammar_matcher is not None and len(within_grammar(req.grammar_matcher, drafts[i])) < len(drafts[i]):
                drafts[i].pop()
                if qs[a]:
                    qs[a].pop()
                continue
            if len(drafts[i]) < k:
                keep.append(n)
        return keep

    def draft_probs(self, req: Any) -> Any:
        row = self._rows.get(req.uid)
        return row.q if row is not None else None

    def accepted(self, req: Any) -> None:
        row = self._rows.get(req.uid)
        if row is None:
            return
        # the drafts' KV up to what the target accepted is the KV of real tokens now
        row.cached = max(row.cached, min(row.end, req.cached_len))
        row.end = row.cached
        row.q = None

    def release(self, req: Any) -> None:
        row = self._rows.pop(req.uid, None)
        if row is not None:
            self.allocator.free(row.pages)

    def check_idle(self) -> None:
        assert not self._rows, f"draft model state kept for requests {list(self._rows)}"
        assert self.allocator.num_free == self.allocator.num_pages, (
            f"draft page leak: {self.allocator.num_free} free of {self.allocator.num_pages}"
        )
        assert len(set(self.allocator._free)) == self.allocator.num_free, "a draft page was freed twice"

    # ---- the draft engine --------------------------------------------------------------------
    def _ensure_pages(self, row: _Row, table_row: int, positions: int) -> bool:
        """Pages for positions [0, positions) of the row (False: the pool cannot hold them; it
        holds as many pages as the target's, and a request never more draft pages than target
        pages but for a grammar row's cut draft, so only a full target pool gets here)."""
        ps = self.page_size
        need = div_ceil(positions, ps) - len(row.pages)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        new = self.allocator.alloc(need)
        first = len(row.pages) * ps
        row.pages += new
        slots = [p * ps + s for p in new for s in range(ps)]
        with stream_context(self.engine.stream):
            self.engine.page_table[table_row, first : first + len(slots)] = make_device_tensor(slots, torch.int32, self.device)
        return True

    def _catch_up(self, rows: List[Tuple[Any, _Row]]) -> torch.Tensor:
        """Feed each row the real tokens the draft has no KV for (the prompt at a request's first
        proposal, then the accepted run and the target's token): the logits after each row's
        last token ([rows, V]) give its first draft. In forwards of at most max_extend_tokens
        tokens, as the target chunks its prefills (a long prompt is fed over several; a row's
        logits come from the forward that feeds its last token)."""
        budget = self.max_extend_tokens
        at = [row.cached for _, row in rows]
        assert all(a < req.device_len for a, (req, _) in zip(at, rows)), "the draft's KV ran past the target's tokens"
        last: List[torch.Tensor | None] = [None] * len(rows)
        pending = list(range(len(rows)))
        while pending:
            feeds: List[Tuple[_Row, int, int]] = []
            ids: List[int] = []
            fed: List[Tuple[int, bool]] = []  # (row, whether its last token is fed)
            for a in pending:
                req, row = rows[a]
                take = min(req.device_len - at[a], budget - len(ids))
                if take <= 0:
                    break
                feeds.append((row, at[a], take))
                ids += req.token_ids[at[a] : at[a] + take]
                at[a] += take
                fed.append((a, at[a] == req.device_len))
            logits = self._forward(feeds, ids)
            for n, (a, done) in enumerate(fed):
                if done:
                    last[a] = logits[n]
            pending = [a for a in pending if last[a] is None]
        for req, row in rows:
            row.cached = req.device_len
        return torch.stack([t for t in last if t is not None])

    def _forward(self, feeds: List[Tuple[_Row, int, int]], ids: List[int] | torch.Tensor) -> torch.Tensor:
        """One draft forward: each row `(row, start, n)` feeds n tokens at positions from `start`
        (its KV written there), `ids` all the fed tokens in order (host ints, or int32 on the
        device); the logits after each row's last fed token ([rows, V])."""
        engine = self.engine
        reqs: List[Req] = []
        rows: List[int] = []
        positions: List[int] = []
        for row, start, n in feeds:
            view = row.view
            view.cached_len, view.device_len = start, start + n
            reqs.append(view)
            rows += [view.table_idx] * n
            positions += range(start, start + n)
        batch = Batch(reqs=reqs, phase="decode" if len(positions) == len(reqs) else "prefill")
        engine.graph_runner.pad_batch(batch)
        with stream_context(engine.stream):
            batch.input_ids = ids if isinstance(ids, torch.Tensor) else make_device_tensor(ids, torch.int32, self.device)
            pos = make_device_tensor(positions, torch.int64, self.device)
            batch.out_loc = engine.page_table[make_device_tensor(rows, torch.int64, self.device), pos]
            batch.positions = pos.to(torch.int32)
            engine.attn_backend.prepare_metadata(batch)
            return engine.logits(batch)

    def _choose(
        self, reqs: List[Any], prefixes: List[List[int]], logits: torch.Tensor, grammar: Any
    ) -> Tuple[torch.Tensor, List[Any] | None]:
        """Each row's next draft after its drafts `prefixes` from the draft's `logits`, with the
        sampler's adjustments at that position (as verification applies them to the target's):
        the argmax for a greedy row; for a sampled row a draw from q (temperature, top-k, top-p,
        min-p), returned with q for rejection sampling."""
        adjusted = logits
        if any(_adjusts(r) for r in reqs):
            views = [_AtDraft(r, r.device_len + len(d)) for r, d in zip(reqs, prefixes)]
            args = make_verify_args(views, prefixes, self.vocab_size, self.device, grammar)
            last = torch.tensor([len(d) for d in prefixes], dtype=torch.int64).add_(1).cumsum_(0).sub_(1).to(self.device)
            full = logits.new_zeros(int(last[-1]) + 1, logits.shape[1])
            full[last] = logits
            adjusted = adjusted_logits(full, args, grammar)[last]
        tokens = greedy_tokens(adjusted).to(torch.int64)
        sampled = [n for n, r in enumerate(reqs) if not r.sampling_params.is_greedy]
        if not sampled:
            return tokens, None
        params = [reqs[n].sampling_params for n in sampled]
        idx = make_device_tensor(sampled, torch.int64, self.device)
        temps = make_device_tensor([max(p.temperature, MIN_T) for p in params], torch.float32, self.device)
        top_k = make_device_tensor([p.top_k if p.top_k >= 1 else self.vocab_size for p in params], torch.int32, self.device)
        top_p = make_device_tensor([min(max(p.top_p, MIN_P), 1.0) for p in params], torch.float32, self.device)
        min_p = make_device_tensor([p.min_p for p in params], torch.float32, self.device)
        use_min_p = any(p.min_p > 0.0 for p in params)
        q = filtered_probs(adjusted.index_select(0, idx).float(), temps, top_k, top_p, min_p if use_min_p else None)
        q = q / q.sum(dim=-1, keepdim=True)
        tokens[idx] = torch.multinomial(q, 1).squeeze(1)
        probs: List[Any] = [None] * len(reqs)
        for n, row in zip(sampled, q):
            probs[n] = row
        return tokens, probs


def _adjusts(req: Any) -> bool:
    """The row's logits get more than temperature and the filters: penalties, logit_bias, the
    min_tokens ban or a grammar mask."""
    p = req.sampling_params
    return p.has_penalties or bool(p.logit_bias) or bool(p.min_tokens) or req.grammar_matcher is not None
