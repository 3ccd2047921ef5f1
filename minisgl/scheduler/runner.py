"""The runner: executes a StepPlan on the device. The only scheduler code that touches torch,
the device or the engine.

Token ids never round-trip through the host during decode: the token pool (one row per table
row, on the device) holds prompts and sampled tokens, and each batch gathers its input ids from
it. Inputs are staged on a side stream, so with overlap scheduling the host prepares step N+1
while the device still runs step N; `wait` is where the host meets the device again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from minisgl.core import Batch
from minisgl.engine import Engine, ForwardOutput
from minisgl.engine.spec_verify import make_verify_args
from minisgl.kvcache.pool import HybridKVCachePool
from minisgl.scheduler.plan import StepPlan, Write
from minisgl.utils.device import create_stream, make_device_tensor, record_stream, stream_context

# per row: (logprob of the sampled token, [(token id, logprob)] of the top k it asked for)
RowLogprobs = Tuple[float, List[Tuple[int, float]]]


@dataclass
class StepResult:
    """One step's results on the host."""

    tokens: List[int]  # the token sampled for each row
    logprobs: List[RowLogprobs | None] | None = None  # None: no row asked
    # (logprob, top logprobs, top ids) per prompt-logprob row of the plan, as host lists
    prompt_logprobs: Tuple[List[float], List[List[float]], List[List[int]]] | None = None
    # the embed task: per row its pooled vector as float32 little-endian bytes (None: its prompt
    # continues in a later chunk); None for a generate step
    embeddings: List[bytes | None] | None = None
    # a verify step: per row the target's token after each fed token ([] for a row
    # without drafts); None for any other step
    verify: List[List[int]] | None = None
    # ... and their logprobs, per row per fed token, for the rows that asked (else None)
    verify_logprobs: List[List[RowLogprobs] | None] | None = None


@dataclass
class Flight:
    """A launched step: its plan, the engine's batch and what the forward returned."""

    plan: StepPlan
    batch: Batch
    output: ForwardOutput


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the engine cannot be trusted: no memory, or the device reported an
    error (a CUDA error poisons the context: every later kernel fails too)."""
    if isinstance(exc, MemoryError) or isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in ("CUDA error", "CUBLAS_STATUS", "cuDNN error", "device-side assert"))


class Runner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.device = engine.device
        # token ids of every table row on the device; the last row is the dummy request's
        self.token_pool = torch.zeros_like(engine.page_table)
        self.stream = create_stream(self.device)  # host-to-device staging, apart from the engine's stream
        # a page's slot offsets, for the window pool's translation writes (made once, not per step)
        self._page_offsets = torch.arange(engine.config.page_size, dtype=torch.int64, device=self.device)

    is_fatal = staticmethod(is_fatal)

    def use_grammar(self, backend: object) -> None:
        self.engine.sampler.grammar = backend

    def launch(self, plan: StepPlan) -> Flight:
        """Write the plan's page-table and token-pool entries, stage its inputs and launch the
        forward (it returns before the device is done). Call it under torch.inference_mode. `plan.reqs` are the rows' Req objects:
        the engine advances each with `complete_one`."""
        engine = self.engine
        self._flush(engine.page_table, plan.page_writes)
        self._flush(self.token_pool, plan.token_writes)
        if plan.window_writes:
            self._flush_translation(plan.window_writes)
        batch = Batch(reqs=list(plan.reqs), phase="decode" if plan.is_decode else "prefill")
        batch.num_decode_rows = plan.num_decode_rows
        engine.graph_runner.pad_batch(batch)
        pads = batch.padded_reqs[plan.size :]  # the dummy request, up to a CUDA-graph size
        if plan.is_decode:
            rows = plan.rows + [r.table_idx for r in pads]
            positions = plan.starts + [r.device_len - 1 for r in pads]  # a decode row feeds its last token
        else:
            rows, positions = [], []
            for row, start, end in zip(plan.rows + [r.table_idx for r in pads], plan.starts + [r.cached_len for r in pads],
                                       plan.ends + [r.device_len for r in pads]):  # fmt: skip
                rows += [row] * (end - start)
                positions += range(start, end)
            if plan.drafts:
                self._stage_verify(plan, batch)
            else:
                self._stage_prompt_logprobs(plan, batch)
        with stream_context(self.stream):
            rows_t = make_device_tensor(rows, torch.int64, self.device)
            pos_t = make_device_tensor(positions, torch.int64, self.device)
        # staged on the runner's stream, read on the engine stream (after the forward, too)
        record_stream(rows_t, engine.stream)
        record_stream(pos_t, engine.stream)
        args = engine.sampler.prepare(batch)
        engine.stream.wait_stream(self.stream)
        with stream_context(engine.stream):
            batch.input_ids = self.token_pool[rows_t, pos_t]
            batch.out_loc = engine.page_table[rows_t, pos_t]
            batch.positions = pos_t.to(torch.int32)
            engine.attn_backend.prepare_metadata(batch)
            output = engine.forward_batch(batch, args)
            if output.embeddings is not None:  # an embed step samples nothing: no token to keep
                return Flight(plan, batch, output)
            # Each request's last fed token sits at (row, p); its sample belongs at (row, p + 1).
            n = batch.size
            last = slice(0, n) if batch.is_decode else batch.attn_metadata.last_indices[:n]
            rows_w, pos_w = rows_t[last], pos_t[last] + 1
            tokens = output.next_tokens_gpu
            if not batch.is_decode and not all(plan.emits):  # a mid-prompt chunk's sample is discarded: keep the prompt token
                keep = make_device_tensor(plan.emits, torch.bool, self.device)
                tokens = torch.where(keep, tokens, self.token_pool[rows_w, pos_w])
            self.token_pool[rows_w, pos_w] = tokens
        return Flight(plan, batch, output)

    def _flush_translation(self, pairs: List[Tuple[int, int]]) -> None:
        """Point each slot of the step's new main pages at its window page's slot (the hybrid
        pool's translation, kvcache/window.py): one scatter, on the staging stream like the
        page-table writes (no step in flight reads these main pages)."""
        pool = self.engine.kv_cache
        assert isinstance(pool, HybridKVCachePool), "window writes for a pool without a window pool"
        translation = pool.translation
        ps = self.engine.config.page_size
        with stream_context(self.stream):
            pairs_t = make_device_tensor([p for pair in pairs for p in pair], torch.int64, self.device).view(-1, 2)
            offsets = self._page_offsets
            translation[(pairs_t[:, :1] * ps + offsets).view(-1)] = (pairs_t[:, 1:] * ps + offsets).view(-1)

    def _flush(self, target: torch.Tensor, writes: List[Write]) -> None:
        """One scatter for a step's queued writes to the page table or the token pool."""
        if not writes:
            return
        limit = target.shape[1]
        rows: List[int] = []
        cols: List[int] = []
        vals: List[int] = []
        for row, start, values in writes:
            values = values[: max(0, limit - start)]
            rows += [row] * len(values)
            cols += range(start, start + len(values))
            vals += values
        with stream_context(self.stream):
            r = make_device_tensor(rows, torch.int64, self.device)
            c = make_device_tensor(cols, torch.int64, self.device)
            target[r, c] = make_device_tensor(vals, torch.int32, self.device)

    def _stage_prompt_logprobs(self, plan: StepPlan, batch: Batch) -> None:
        plp = plan.prompt_logprobs
        if plp is None:
            return
        batch.prompt_logprob_counts = plp.counts
        if plp.rows:
            with stream_context(self.stream):
                batch.prompt_logprob_rows = make_device_tensor(plp.rows, torch.int64, self.device)
                batch.prompt_logprob_targets = make_device_tensor(plp.targets, torch.int64, self.device)
            record_stream(batch.prompt_logprob_rows, self.engine.stream)
            record_stream(batch.prompt_logprob_targets, self.engine.stream)

    def _stage_verify(self, plan: StepPlan, batch: Batch) -> None:
        """A verify step: every fed row of a row with drafts (its last token and the drafts)
        goes through the LM head."""
        rows: List[int] = []
        offset = 0
        for start, end, draft in zip(plan.starts, plan.ends, plan.drafts):
            if draft:
                rows += range(offset, offset + end - start)
            offset += end - start
        probs = plan.draft_probs or [None] * len(plan.drafts)
        with_drafts = [(req, d, q) for req, d, q in zip(plan.reqs, plan.drafts, probs) if d]
        reqs, drafts, qs = [r for r, _, _ in with_drafts], [d for _, d, _ in with_drafts], [q for _, _, q in with_drafts]
        with stream_context(self.stream):
            sampler = self.engine.sampler
            batch.verify_args = make_verify_args(reqs, drafts, sampler.vocab_size, self.device, sampler.grammar, qs)
            batch.prompt_logprob_rows = make_device_tensor(rows, torch.int64, self.device)
        record_stream(batch.prompt_logprob_rows, self.engine.stream)
        args = batch.verify_args
        tensors = [args.drafts, args.sampled, args.temperatures, args.top_k, args.top_p, args.min_p, args.draft_probs]
        if args.penalties is not None:
            pen = args.penalties
            tensors += [pen.rows, pen.tokens, pen.output_counts, pen.presence, pen.frequency, pen.repetition]
        if args.bias is not None:
            tensors += [args.bias.rows, args.bias.tokens, args.bias.values]
        for t in tensors:
            if t is not None:
                record_stream(t, self.engine.stream)

    def wait(self, flight: Flight) -> None:
        """Block until the step's results are on the host."""
        flight.output.copy_done_event.synchronize()

    def results(self, flight: Flight) -> StepResult:
        """The step's results as host lists (after `wait`)."""
        out = flight.output
        result = StepResult(out.next_tokens_cpu.tolist())
        lp = out.logprobs
        if lp is not None:
            rows: List[RowLogprobs | None] = []
            for i, req in enumerate(flight.batch.reqs):
                k = req.sampling_params.logprobs
                rows.append(None if k is None else (float(lp[0][i]), list(zip(lp[2][i, :k].tolist(), lp[1][i, :k].tolist()))))
            result.logprobs = rows
        if out.embeddings is not None:
            vectors = out.embeddings.numpy().astype("<f4")
            result.embeddings = [vectors[i].tobytes() if emits else None for i, emits in enumerate(flight.plan.emits)]
        if out.verify_tokens is not None:
            flat = out.verify_tokens.tolist()
            vlp = out.verify_logprobs
            chosen, top_vals, top_ids = (t.tolist() for t in vlp) if vlp is not None else ([], [], [])
            verify: List[List[int]] = []
            verify_lps: List[List[RowLogprobs] | None] = []
            at = 0
            for req, drafts in zip(flight.batch.reqs, flight.plan.drafts):
                n = len(drafts) + 1 if drafts else 0
                verify.append(flat[at : at + n])
                k = req.sampling_params.logprobs
                verify_lps.append(
                    None if k is None or vlp is None
                    else [(chosen[j], list(zip(top_ids[j][:k], top_vals[j][:k]))) for j in range(at, at + n)]
                )  # fmt: skip
                at += n
            result.verify = verify
            result.verify_logprobs = verify_lps if vlp is not None else None
        if out.prompt_logprobs is not None:
            # to host lists once per step, not a tensor op per prompt token
            values, top_values, top_ids = (t.tolist() for t in out.prompt_logprobs)
            result.prompt_logprobs = (values, top_values, top_ids)
        return result

    def synchronize(self) -> None:
        """Nothing launched may still run (before pages are reused after a failed step)."""
        self.stream.synchronize()
        self.engine.stream.synchronize()
