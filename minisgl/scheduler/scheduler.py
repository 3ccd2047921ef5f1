"""The scheduler: owns one Engine and runs the step loop.

Each step admits waiting requests (matching cached prefixes, reserving KV pages for their
worst case so decode never runs out of memory), picks a prefill batch (chunked under a token
budget) or a decode batch, prepares its inputs on the device, and hands it to the engine.

Token ids never round-trip through the host during decode: the token pool (one row per running
request, on the device) holds prompts and sampled tokens, and each batch gathers its input ids
from it. With overlap scheduling, step N+1 is prepared and launched before step N's results are
read back, so the host work hides behind the device's; results then lag by one step, and pages
of requests that finished are released only after the step that may still use them completes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Set

import torch

from minisgl.core import Batch, Req
from minisgl.engine import Engine, ForwardOutput
from minisgl.kvcache import PageAllocator, create_cache_manager
from minisgl.message.outputs import SchedulerStats  # crosses processes as itself
from minisgl.sampling_params import InvalidRequest, check_context, check_token_ids
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.request import SchedReq, TokenOutput, UserRequest
from minisgl.utils.device import create_stream, make_device_tensor, record_stream, stream_context
from minisgl.utils.hf import resolve_model_path
from minisgl.utils.logger import init_logger
from minisgl.utils.misc import div_ceil

logger = init_logger(__name__)


class StepFailed(RuntimeError):
    """`Scheduler.step()` raised; the requests in `uids` were ended (finish reason "error") and
    their resources released. `outputs` are the step's results that were ready before the error
    (abort notices); `__cause__` is the original exception."""

    def __init__(self, uids: List[int], outputs: List[TokenOutput], cause: BaseException) -> None:
        super().__init__(f"a scheduler step failed ({type(cause).__name__}: {cause}); requests ended: {uids}")
        self.uids = uids
        self.outputs = outputs


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


@dataclass
class _InFlight:
    batch: Batch
    output: ForwardOutput
    # requests whose sampled token is real (not a non-final prefill chunk), by batch row
    emits: List[bool]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if config.max_extend_tokens < 1:
            raise ValueError(f"max_extend_tokens must be >= 1, got {config.max_extend_tokens}")
        self.engine = Engine(config)
        self.config = config
        self.device = self.engine.device
        # On a CPU the forward runs to completion inside the launch: there is nothing for the
        # host to overlap, and reading results a step late only delays every token by a step
        # (TTFT of a 500-token prompt on the embedded model: 115 -> 96 ms). An explicit
        # enable_overlap still wins (the tests run both ways).
        self.overlap = config.overlap and (config.enable_overlap is not None or self.device.type != "cpu")
        self.page_size = config.page_size
        self.alloc_ahead = max(0, 16 - self.page_size)  # decode tokens of pages allocated ahead
        self.max_seq_len = self.engine.max_seq_len
        self.vocab_size = self.engine.config.model_config.vocab_size
        self.allocator = PageAllocator(self.engine.num_pages)
        self.cache = create_cache_manager(config.cache_type, self.page_size)
        self.free_rows: List[int] = list(range(config.max_running_req - 1, -1, -1))
        # token ids of every running request on the device; the last row is the dummy request's
        self.token_pool = torch.zeros_like(self.engine.page_table)
        self.stream = create_stream(self.device)  # host-to-device staging, apart from the engine's stream
        self.eos_ids: Set[int] = set(self.engine.config.model_config.eos_token_ids) | _generation_eos(config.model_path)
        self.waiting: Deque[UserRequest] = deque()
        self.prefilling: List[SchedReq] = []  # admitted, prompt not fully prefilled
        self.running: List[SchedReq] = []  # decoding
        self.retracted: List[SchedReq] = []  # pages taken back; resumed before any new request
        self.new_token_ratio = config.init_new_token_ratio
        # shares of their max_tokens that recently finished requests used: the estimate's target
        self._finished_shares: Deque[float] = deque(maxlen=64)
        self._ratio_target = config.min_new_token_ratio  # where the estimate decays to (see _finish)
        self._decode_need = 0  # pages the scheduled step's decode rows need (set by _schedule)
        self._admit_counter = 0
        self._retractions = 0
        self._mixed_steps = 0
        self._peak_running = 0
        self.active: Dict[int, SchedReq] = {}
        self._queued_uids: Set[int] = set()
        self._reserved = 0
        self._in_flight: _InFlight | None = None
        self._deferred: List[SchedReq] = []
        # (row, first column, values) writes to the page table / token pool, flushed per launch
        self._pt_writes: List[tuple[int, int, List[int]]] = []
        self._tp_writes: List[tuple[int, int, List[int]]] = []  # finished; freed once no in-flight step can touch them
        self._last_phase = "decode"
        self._early: List[TokenOutput] = []  # outputs produced outside a step (aborts)
        self._prompt_tokens = self._hit_tokens = self._generated = 0
        self._steps = {"prefill": 0, "decode": 0}
        self._num_penalized = 0  # admitted requests whose sampling needs the host-side history
        self._num_constrained = 0  # admitted requests with a grammar (their next mask needs the last token)
        self.grammar: Any = None  # GrammarBackend, created by the first request with a grammar
        self._host_s = self._wait_s = 0.0
        self._step_batches: List[Batch] = []  # what the current step scheduled (for _recover)
        self._processing: _InFlight | None = None  # the step whose results are being read

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, req: UserRequest) -> None:
        """Raise InvalidRequest (a ValueError) naming what is wrong with the request (nothing is
        changed). The same checks as the API server's, so the offline API and the server agree."""
        if req.uid in self._queued_uids or req.uid in self.active:
            raise InvalidRequest(f"request uid {req.uid} is already in use")
        check_token_ids(req.input_ids, self.vocab_size, "input_ids")
        # max_tokens against the context: check_context refuses (strict) or clips (a default)
        req.sampling_params.validate(self.vocab_size)
        if req.sampling_params.priority != 0 and self.config.schedule_policy != "priority":
            raise InvalidRequest(
                "priority scheduling is off: start the server with --schedule-policy priority to use 'priority'", param="priority"
            )
        if req.sampling_params.grammar is not None:
            self._grammar_backend().compile(req.sampling_params.grammar)  # a bad grammar is a 400 now
        check_context(len(req.input_ids), req.sampling_params.max_tokens, self.max_seq_len, strict=req.strict_max_tokens)

    def _grammar_backend(self) -> Any:
        if self.grammar is None:
            from minisgl.scheduler.grammar import GrammarBackend
            from minisgl.utils.hf import load_tokenizer

            self.grammar = GrammarBackend(load_tokenizer(self.config.model_path), self.vocab_size)
            self.engine.sampler.grammar = self.grammar
        return self.grammar

    def add_request(self, req: UserRequest) -> None:
        self.validate(req)
        priority = req.sampling_params.priority
        if self.config.schedule_policy == "priority" and self.waiting and self.waiting[-1].sampling_params.priority > priority:
            # before the first waiting request that is less urgent (FIFO among equals)
            at = next(i for i, w in enumerate(self.waiting) if w.sampling_params.priority > priority)
            self.waiting.insert(at, req)
        else:
            self.waiting.append(req)
        self._queued_uids.add(req.uid)

    def abort(self, uid: int) -> bool:
        """Stop a request wherever it is; its pages are freed. Returns whether it was found."""
        for i, req in enumerate(self.waiting):
            if req.uid == uid:
                del self.waiting[i]
                self._queued_uids.discard(uid)
                self._early.append(TokenOutput(uid, None, True, "abort", prompt_tokens=len(req.input_ids)))
                return True
        sreq = self.active.get(uid)
        if sreq is None or sreq.finished:
            return False
        self._finish(sreq, "abort")
        self._early.append(TokenOutput(uid, None, True, "abort", prompt_tokens=sreq.prompt_len))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.retracted or self.prefilling or self.running or self._in_flight or self._early)

    # ---- the loop ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> List[TokenOutput]:
        """Schedule and launch one batch; return the tokens of the batch that completed.

        If the step raises, the requests it touched are ended (their pages freed, none of their
        KV kept in the prefix cache) and `StepFailed` names them; the scheduler stays consistent
        and the next step serves everyone else. Errors that mean the engine itself is broken
        (out of memory, a CUDA error) propagate unchanged: see `is_fatal`."""
        outputs, self._early = self._early, []
        self._step_batches = []
        try:
            return outputs + self._step()
        except Exception as exc:
            # With TP ranks in lockstep a rank cannot recover alone (the others may wait in a
            # collective): any failure is fatal there.
            if is_fatal(exc) or self.config.tp_info.size > 1:
                raise
            failed = self._recover()
            raise StepFailed(failed, outputs, exc) from exc

    def _step(self) -> List[TokenOutput]:
        outputs: List[TokenOutput] = []
        decodable, need = self._decodable()
        if self._in_flight is not None and need > self._available_pages():
            # Retraction frees pages at once: first finish the step that may still write them
            # (its tokens are real output; finished requests return their pages too).
            flight, self._in_flight = self._in_flight, None
            outputs += self._process(flight)
            self._release_deferred()
            decodable, need = self._decodable()
        start = time.perf_counter()
        batch = self._schedule(decodable, need)
        if batch is not None:
            self._step_batches.append(batch)
        launched = self._launch(batch) if batch is not None else None
        self._host_s += time.perf_counter() - start
        if batch is not None:
            self._steps[batch.phase] += 1
        # Penalties read every generated token on the host, so while any admitted request uses
        # them the loop runs synchronously (a counter, not a per-step scan of the batch).
        must_sync = launched is not None and (self._num_penalized > 0 or self._num_constrained > 0)
        if self.overlap and not must_sync:
            if self._in_flight is not None:
                outputs += self._process(self._in_flight)
            self._in_flight = launched
        else:
            if self._in_flight is not None:
                outputs += self._process(self._in_flight)
                self._in_flight = None
            if launched is not None:
                outputs += self._process(launched)
        if self._in_flight is None:
            self._release_deferred()
        return outputs

    def _recover(self) -> List[int]:
        """After a failed step: end every request of the batch it scheduled (and of the batch it
        was processing, if that failed), and release what they and earlier finished requests
        hold. A batch still in flight that did not fail is kept: its results are valid."""
        # Nothing may still write to the pages we free. A device that cannot even synchronize
        # is broken: that error propagates.
        self.stream.synchronize()
        self.engine.stream.synchronize()
        batches = list(self._step_batches)
        if self._processing is not None:
            batches.append(self._processing.batch)
            if self._in_flight is self._processing:
                self._in_flight = None
            self._processing = None
        self._pt_writes.clear()
        self._tp_writes.clear()
        failed: List[int] = []
        for batch in batches:
            for i, req in enumerate(batch.reqs):
                if not isinstance(req, SchedReq) or req.finished or self.active.get(req.uid) is not req:
                    continue
                if i < batch.num_decode_rows and req in self.running:
                    # A decode row that rode along with a failed prefill: its KV up to this
                    # step is sound, so it resumes by recompute instead of failing with it.
                    req.cached_len = req.trusted_len
                    req.device_len = len(req.token_ids)
                    self._retract(req)
                    continue
                self._finish(req, "error")
                req.kv_trusted = False
                failed.append(req.uid)
        self._release_deferred()  # safe: the device is idle
        return failed

    def run_until_idle(self) -> List[TokenOutput]:
        out: List[TokenOutput] = []
        while self.has_work():
            out += self.step()
        return out

    # ---- scheduling --------------------------------------------------------------------------
    def _decodable(self) -> tuple[List[SchedReq], int]:
        """The requests that can decode next, and the pages that step needs beyond theirs
        (0 under worst-case admission: their reservations cover it)."""
        decodable = [r for r in self.running if r.can_decode]
        need = self._decode_page_need(decodable) if self.config.admission == "optimistic" else 0
        return decodable, need

    def _schedule(self, decodable: List[SchedReq], need: int) -> Batch | None:
        if need > self._available_pages():
            decodable, need = self._retract_until_fits(decodable, need)
        self._decode_need = need
        want_prefill = bool(self.waiting or self.prefilling or self.retracted)
        if want_prefill and decodable and self.config.mixed_batches:
            # One batch: every decode row (one token each) plus prefill chunks in the rest of
            # the token budget, so no stream waits for a whole prefill step.
            batch = self._schedule_prefill(decodable)
            if batch is not None:
                self._last_phase = "prefill"
                self._mixed_steps += 1
                self._decay_new_token_ratio()
                return batch
        elif want_prefill and (not decodable or self._last_phase == "decode"):
            # Without mixing, alternate: a decode step never waits more than one
            # (budget-bounded) prefill step, and prefills still make progress every other step.
            batch = self._schedule_prefill([])
            if batch is not None:
                self._last_phase = "prefill"
                return batch
        if decodable:
            self._last_phase = "decode"
            self._decay_new_token_ratio()
            return Batch(reqs=list[Req](decodable), phase="decode")
        return None

    # ---- admission and retraction ------------------------------------------------------------
    def _available_pages(self) -> int:
        return self.allocator.num_free + self.cache.evictable_pages - self._reserved

    @property
    def effective_new_token_ratio(self) -> float:
        """The share of its remaining max_tokens a running request is expected to generate."""
        return min(1.0, self.new_token_ratio * self.config.schedule_conservativeness)

    def _future_pages(self, length: int, remaining: int, held: int) -> int:
        """Pages a request of `length` tokens holding `held` pages is expected to still need."""
        expected = length + math.ceil(max(0, remaining) * self.effective_new_token_ratio)
        return max(0, div_ceil(expected, self.page_size) - held)

    def _expected_decode_pages(self) -> int:
        """What admitted requests are expected to still take from the pool while decoding."""
        total = 0
        for r in self.running:
            total += self._future_pages(r.device_len, r.output_len - r.num_output, len(r.pages))
        for r in self.prefilling:
            total += self._future_pages(r.prefill_len, r.output_len - r.num_output, len(r.pages) + r.reserved_pages)
        return total

    def _decode_page_need(self, reqs: List[SchedReq]) -> int:
        ps = self.page_size
        return sum(max(0, div_ceil(r.device_len, ps) - len(r.pages)) for r in reqs)

    def _retract_until_fits(self, decodable: List[SchedReq], need: int) -> tuple[List[SchedReq], int]:
        """Take pages back from the least urgent decoders until this decode step's `need`
        fits; returns who stays and what they need.

        Called with no step in flight (`_step` drains it first), so freed pages are unused."""
        assert self._in_flight is None, "retraction with a step in flight"
        keep = sorted(decodable, key=_urgency)  # the least urgent last
        while keep and need > self._available_pages():
            # Everyone may go: prefilling requests hold reserved pages and always progress, and
            # the retracted resume (from the front of the queue) as pages return.
            victim = keep.pop()
            need -= self._decode_page_need([victim])
            self._retract(victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio * 1.5 + 0.05)
        return keep, need

    def _retract(self, req: SchedReq) -> None:
        """Return a decoding request's row and pages (its KV goes to the prefix cache, so a
        resume finds what survives) and queue it to resume before any new request."""
        self.running.remove(req)
        self._release_pages(req)
        req.num_retractions += 1
        self._retractions += 1
        self.retracted.append(req)
        self.retracted.sort(key=_urgency)
        logger.debug("retracted request %d at %d tokens", req.uid, len(req.token_ids))

    def _decay_new_token_ratio(self) -> None:
        """Each step moves the estimate toward what finished requests used (with a margin), or
        toward the minimum before any finished: optimism grows until a retraction says stop."""
        keep = 1.0 - 1.0 / self.config.new_token_ratio_decay_steps
        self.new_token_ratio = self._ratio_target + (self.new_token_ratio - self._ratio_target) * keep

    def _fits(self, need_now: int, future: int, expected: int) -> bool:
        if self.config.admission == "optimistic":
            return need_now + future + expected <= self._available_pages()
        return need_now <= self._available_pages()

    def _schedule_prefill(self, decoding: List[SchedReq]) -> Batch | None:
        """A prefill batch: chunks of admitted prompts, then resumed and new requests, within
        the token budget; `decoding` rows (one token each) go first when mixing."""
        budget = self.config.max_extend_tokens - len(decoding)
        if budget <= 0:
            return None
        reqs: List[SchedReq] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            chunk = min(req.prefill_len - req.cached_len, budget)
            req.device_len = req.cached_len + chunk
            budget -= chunk
            reqs.append(req)
        optimistic = self.config.admission == "optimistic"
        # (only when something may be admitted: it walks every admitted request)
        expected = self._expected_decode_pages() if optimistic and (self.retracted or self.waiting) else 0
        in_flight = self._in_flight.batch.reqs if self._in_flight is not None else []
        while self.retracted and budget > 0 and self.free_rows:
            req = self.retracted[0]
            if any(r is req for r in in_flight):
                break  # (after a failed step) its last token is still on the way: resume after it
            ids = req.token_ids
            match = self.cache.match_prefix(ids[: len(ids) - 1])
            need = div_ceil(len(ids), self.page_size) - match.num_pages
            future = self._future_pages(len(ids), req.output_len - req.num_output, div_ceil(len(ids), self.page_size))
            if not self._fits(need, future, expected):
                self.cache.unlock(match.handle)
                break
            self.retracted.pop(0)
            req.resume(self.free_rows.pop(), match, self.page_size)
            self._admitted(req, need)
            expected += future
            budget = self._add_chunk(req, budget, reqs)
        while not self.retracted and self.waiting and budget > 0 and self.free_rows:
            user = self.waiting[0]
            prompt_len = len(user.input_ids)
            output_len = check_context(prompt_len, user.sampling_params.max_tokens, self.max_seq_len, strict=False)
            # a request that wants its prompt's logprobs needs every prompt token's logits: no cache hit
            wants_prompt_lp = user.sampling_params.prompt_logprobs is not None
            match = self.cache.match_prefix(user.input_ids[: 0 if wants_prompt_lp else prompt_len - 1])
            prompt_pages = div_ceil(prompt_len, self.page_size)
            if optimistic:  # the prompt is reserved; its decoding is an estimate
                need = prompt_pages - match.num_pages
                future = self._future_pages(prompt_len, output_len, prompt_pages)
            else:  # worst case: prompt and every token it may generate
                need = div_ceil(prompt_len + output_len, self.page_size) - match.num_pages
                future = 0
            if not self._fits(need, future, expected):
                self.cache.unlock(match.handle)
                break  # wait for running requests to finish and return pages
            self.waiting.popleft()
            self._queued_uids.discard(user.uid)
            req = SchedReq(user, self.free_rows.pop(), output_len, match, self.page_size)
            req.stop_ids = set(user.sampling_params.stop_token_ids)
            if not user.sampling_params.ignore_eos:
                req.stop_ids |= self.eos_ids
            self.active[req.uid] = req
            self._num_penalized += user.sampling_params.has_penalties
            if user.sampling_params.grammar is not None:
                req.grammar_matcher = self._grammar_backend().matcher(user.sampling_params.grammar)
                self._num_constrained += 1
            self._prompt_tokens += prompt_len
            self._hit_tokens += req.cached_len
            self._admitted(req, need)
            expected += future
            budget = self._add_chunk(req, budget, reqs)
        if not reqs:
            return None
        running = len(self.running) + len(self.prefilling)
        self._peak_running = max(self._peak_running, running)
        for r in decoding:
            r.trusted_len = r.cached_len  # what survives if this step fails (see _recover)
        batch = Batch(reqs=list[Req](decoding) + list[Req](reqs), phase="prefill")
        batch.num_decode_rows = len(decoding)
        return batch

    def _admitted(self, req: SchedReq, reserve: int) -> None:
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        req.reserved_pages = reserve
        self._reserved += reserve
        self._write_prompt(req)
        self.prefilling.append(req)

    def _add_chunk(self, req: SchedReq, budget: int, reqs: List[SchedReq]) -> int:
        chunk = min(req.prefill_len - req.cached_len, budget)
        req.device_len = req.cached_len + chunk
        reqs.append(req)
        return budget - chunk

    def _write_prompt(self, req: SchedReq) -> None:
        n = req.prefill_len
        self._tp_writes.append((req.table_idx, 0, req.token_ids[:n]))
        if req.pages:  # matched prefix: point the page table at the cached slots
            self._queue_page_table(req, 0, len(req.pages))

    def _alloc_pages(self, req: SchedReq, upto_tokens: int) -> None:
        """Make sure pages cover token positions [0, upto_tokens) of `req`."""
        need = div_ceil(upto_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return
        if self.allocator.num_free < need:
            self.allocator.free(self.cache.evict(need - self.allocator.num_free))
        start = len(req.pages)
        req.pages += self.allocator.alloc(need)
        take = min(need, req.reserved_pages)
        req.reserved_pages -= take
        self._reserved -= take
        self._queue_page_table(req, start, len(req.pages))

    def _queue_page_table(self, req: SchedReq, first_page: int, end_page: int) -> None:
        ps = self.page_size
        if ps == 1:
            slots = req.pages[first_page:end_page]
        else:
            slots = [p * ps + i for p in req.pages[first_page:end_page] for i in range(ps)]
        self._pt_writes.append((req.table_idx, first_page * ps, slots))

    def _flush_writes(self) -> None:
        """One scatter each for the queued page-table and token-pool writes of this step."""
        for target, writes in ((self.engine.page_table, self._pt_writes), (self.token_pool, self._tp_writes)):
            if not writes:
                continue
            limit = target.shape[1]
            rows: List[int] = []
            cols: List[int] = []
            vals: List[int] = []
            for row, start, values in writes:
                values = values[: max(0, limit - start)]
                rows += [row] * len(values)
                cols += range(start, start + len(values))
                vals += values
            writes.clear()
            with stream_context(self.stream):
                r = make_device_tensor(rows, torch.int64, self.device)
                c = make_device_tensor(cols, torch.int64, self.device)
                target[r, c] = make_device_tensor(vals, torch.int32, self.device)

    # ---- launching ---------------------------------------------------------------------------
    def _launch(self, batch: Batch) -> _InFlight:
        engine = self.engine
        ps = self.page_size
        ahead = self.alloc_ahead
        if self.config.admission == "optimistic" and ahead:
            # ahead of need only while the pool has room to spare for it
            spare = self._available_pages() - self._decode_need
            if spare < 2 * batch.size * div_ceil(ahead, ps):
                ahead = 0
        for req in batch.reqs:
            if req.device_len > len(req.pages) * ps:  # type: ignore[attr-defined]
                # Allocate a few steps ahead: with page_size 1 a decode step would otherwise
                # allocate, and write the page table, for every request every step.
                decoding = batch.is_decode or req.prefill_done  # type: ignore[attr-defined]
                upto = min(req.device_len + ahead, req.max_device_len) if decoding else req.device_len
                self._alloc_pages(req, upto)  # type: ignore[arg-type]
        self._flush_writes()
        engine.graph_runner.pad_batch(batch)
        if batch.is_decode:
            rows = [r.table_idx for r in batch.padded_reqs]
            positions = [r.device_len - 1 for r in batch.padded_reqs]
        else:
            rows, positions = [], []
            for req in batch.padded_reqs:
                rows += [req.table_idx] * (req.device_len - req.cached_len)
                positions += range(req.cached_len, req.device_len)
            self._stage_prompt_logprobs(batch)
        with stream_context(self.stream):
            rows_t = make_device_tensor(rows, torch.int64, self.device)
            pos_t = make_device_tensor(positions, torch.int64, self.device)
        # staged on the scheduler stream, read on the engine stream (after the forward, too)
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
            # after complete_one: a request emits a real token once its whole prompt has KV
            emits = [r.prefill_done for r in batch.reqs]  # type: ignore[attr-defined]
            # Each request's last fed token sits at (row, p); its sample belongs at (row, p + 1).
            n = batch.size
            last = slice(0, n) if batch.is_decode else batch.attn_metadata.last_indices[:n]
            rows_w, pos_w = rows_t[last], pos_t[last] + 1
            tokens = output.next_tokens_gpu
            if not all(emits):  # a mid-prompt chunk's sample is discarded: keep the prompt token
                keep = make_device_tensor(emits, torch.bool, self.device)
                tokens = torch.where(keep, tokens, self.token_pool[rows_w, pos_w])
            self.token_pool[rows_w, pos_w] = tokens
        if batch.is_prefill:  # bookkeeping the next schedule depends on
            for i, (req, real) in enumerate(zip(batch.reqs, emits)):
                assert isinstance(req, SchedReq)
                if i < batch.num_decode_rows:
                    continue  # a mixed batch's decode rows are running already
                if not real:
                    req.device_len = req.cached_len  # mid-prompt chunk: the next chunk continues here
                else:
                    self.prefilling.remove(req)
                    self.running.append(req)
        return _InFlight(batch, output, emits)

    def _stage_prompt_logprobs(self, batch: Batch) -> None:
        """Prefill: the flattened token rows whose logits give prompt logprobs (position p
        predicts prompt token p + 1), and those target tokens."""
        if not any(_wants_prompt_logprobs(r) for r in batch.reqs):
            return
        rows: List[int] = []
        targets: List[int] = []
        counts: List[int] = []  # per request of the batch: prompt logprobs this step produces
        offset = 0
        for i, req in enumerate(batch.padded_reqs):
            n = req.device_len - req.cached_len
            count = 0
            if _wants_prompt_logprobs(req):
                assert isinstance(req, SchedReq)
                last = min(req.device_len, req.prompt_len - 1)  # the last prompt token predicts nothing here
                for p in range(req.cached_len, last):
                    rows.append(offset + p - req.cached_len)
                    targets.append(req.token_ids[p + 1])
                count = max(0, last - req.cached_len)
            if i < batch.size:
                counts.append(count)
            offset += n
        batch.prompt_logprob_counts = counts
        if rows:
            with stream_context(self.stream):
                batch.prompt_logprob_rows = make_device_tensor(rows, torch.int64, self.device)
                batch.prompt_logprob_targets = make_device_tensor(targets, torch.int64, self.device)
            record_stream(batch.prompt_logprob_rows, self.engine.stream)
            record_stream(batch.prompt_logprob_targets, self.engine.stream)

    # ---- results -----------------------------------------------------------------------------
    def _process(self, flight: _InFlight) -> List[TokenOutput]:
        self._processing = flight
        outputs = self._process_flight(flight)
        self._processing = None
        return outputs

    def _process_flight(self, flight: _InFlight) -> List[TokenOutput]:
        start = time.perf_counter()
        flight.output.copy_done_event.synchronize()
        self._wait_s += time.perf_counter() - start
        self._release_deferred()  # every step before this one has completed
        tokens = flight.output.next_tokens_cpu.tolist()
        lp = flight.output.logprobs
        # prompt logprobs: to host lists once per step, not a tensor op per prompt token
        plp = None if flight.output.prompt_logprobs is None else [t.tolist() for t in flight.output.prompt_logprobs]
        plp_at = 0
        outputs: List[TokenOutput] = []
        for i, (req, real) in enumerate(zip(flight.batch.reqs, flight.emits)):
            assert isinstance(req, SchedReq)
            n = flight.batch.prompt_logprob_counts[i] if plp is not None else 0
            if n:  # this chunk's prompt logprobs (rows in batch order)
                assert plp is not None
                k = req.sampling_params.prompt_logprobs or 0
                start = len(req.prompt_lp)  # logprobs so far = prompt position of the next one
                targets = req.token_ids[start + 1 : start + 1 + n]
                for j in range(n):
                    tops = list(zip(plp[2][plp_at + j][:k], plp[1][plp_at + j][:k]))
                    req.prompt_lp.append([targets[j], plp[0][plp_at + j], tops])
                plp_at += n
            if not real or req.finished:
                continue
            token = tokens[i]
            req.append_token(token)
            self._generated += 1
            out = TokenOutput(req.uid, token, prompt_tokens=req.prompt_len, cached_tokens=req.num_cached_prompt)
            if req.sampling_params.prompt_logprobs is not None and req.num_output == 1:
                out.prompt_logprobs, req.prompt_lp = req.prompt_lp, []
            if lp is not None and req.sampling_params.logprobs is not None:
                k = req.sampling_params.logprobs
                out.logprob = float(lp[0][i])
                out.top_logprobs = list(zip(lp[2][i, :k].tolist(), lp[1][i, :k].tolist()))
            matcher = req.grammar_matcher
            if matcher is not None and not matcher.accept_token(token):
                logger.warning("request %d: token %d is outside its grammar", req.uid, token)
            if token in req.stop_ids or (matcher is not None and matcher.is_terminated()):
                self._finish(req, "stop")
            elif req.num_output >= req.output_len:
                self._finish(req, "length")
            out.finished, out.finish_reason = req.finished, req.finish_reason
            outputs.append(out)
        return outputs

    def _finish(self, req: SchedReq, reason: str) -> None:
        req.finished, req.finish_reason = True, reason
        if req in self.running:
            self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.retracted:
            self.retracted.remove(req)
        if reason in ("stop", "length") and req.output_len > 0:
            shares = self._finished_shares
            shares.append(req.num_output / req.output_len)
            self._ratio_target = min(1.0, max(self.config.min_new_token_ratio, 1.25 * sum(shares) / len(shares)))
        self._deferred.append(req)

    def _release_deferred(self) -> None:
        for req in self._deferred:
            self._release(req)
        self._deferred = []

    def _release(self, req: SchedReq) -> None:
        """Return a finished request's row and pages, and drop its counters."""
        self._release_pages(req)
        self._num_penalized -= req.sampling_params.has_penalties
        if req.grammar_matcher is not None:
            self._num_constrained -= 1
            req.grammar_matcher = None
        del self.active[req.uid]

    def _release_pages(self, req: SchedReq) -> None:
        """Return a request's row and pages; its full pages go to the prefix cache (after a
        failed step only the prefix it found there: its own KV cannot be trusted)."""
        if req.is_retracted:  # released when it was retracted
            return
        known = min(req.cached_len, len(req.token_ids)) if req.kv_trusted else req.matched_len
        full = min(known // self.page_size, len(req.pages))
        ids = req.token_ids[: full * self.page_size]
        to_free, _ = self.cache.insert(ids, req.pages[:full])
        to_free += req.pages[full:]
        self.cache.unlock(req.cache_handle)
        req.cache_handle = None
        self.allocator.free(to_free)
        self._reserved -= req.reserved_pages
        req.reserved_pages = 0
        req.pages = []
        self.free_rows.append(req.table_idx)
        req.table_idx = -1

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running) + len(self.prefilling),
            num_waiting=len(self.waiting) + len(self.retracted),
            total_pages=self.allocator.num_pages,
            free_pages=self.allocator.num_free + self.cache.evictable_pages,
            cached_pages=self.cache.cached_pages,
            prompt_tokens=self._prompt_tokens,
            cache_hit_tokens=self._hit_tokens,
            generated_tokens=self._generated,
            prefill_steps=self._steps["prefill"],
            decode_steps=self._steps["decode"],
            mixed_steps=self._mixed_steps,
            num_retracted=len(self.retracted),
            retractions=self._retractions,
            peak_running=self._peak_running,
            new_token_ratio=self.effective_new_token_ratio,
            host_s=self._host_s,
            wait_s=self._wait_s,
        )

    def check_invariants(self) -> None:
        """When idle: every page is free or held unpinned by the cache, every row is free."""
        assert not self.has_work(), "check_invariants() needs an idle scheduler"
        assert not self.active and not self._deferred, f"requests still hold resources: {list(self.active)}"
        total = self.allocator.num_pages
        assert self.allocator.num_free + self.cache.cached_pages == total, (
            f"page leak: {self.allocator.num_free} free + {self.cache.cached_pages} cached != {total}"
        )
        assert self.cache.evictable_pages == self.cache.cached_pages, "a cached page is still pinned"
        assert len(self.free_rows) == self.config.max_running_req, "a table row leaked"
        assert len(set(self.allocator._free)) == self.allocator.num_free, "a page was freed twice"
        assert self._reserved == 0, f"{self._reserved} pages still reserved"
        assert self._num_penalized == 0, "a finished request is still counted as using penalties"
        assert self._num_constrained == 0, "a finished request is still counted as constrained"

    def reset_prefix_cache(self) -> int:
        """Drop every unpinned cached page; returns how many were freed."""
        freed = self.cache.reset()
        self.allocator.free(freed)
        return len(freed)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _urgency(req: SchedReq) -> tuple[int, int]:
    """Sort key: the most urgent first (priority, then admission order; priority is 0 under FCFS)."""
    return (req.sampling_params.priority, req.admit_seq)


def _wants_prompt_logprobs(req: Req) -> bool:
    # a resumed request sent its prompt logprobs before it was retracted
    return req.sampling_params.prompt_logprobs is not None and isinstance(req, SchedReq) and req.num_retractions == 0


def _generation_eos(model_path: str) -> Set[int]:
    import json
    from pathlib import Path

    try:
        path = Path(resolve_model_path(model_path)) / "generation_config.json"
        eos: Any = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    except (OSError, ValueError):
        return set()
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
