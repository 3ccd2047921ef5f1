"""The scheduling policy: host only, on integers and lists.

Each step admits waiting requests (matching cached prefixes; optimistic admission reserves the
prompt and estimates the rest, worst-case reserves everything), picks a prefill batch (chunked
under a token budget, decode rows riding along) or a decode batch, allocates its pages and
returns a `StepPlan`; the step's host results (from a runner) become `TokenOutput`s. When a
decode step cannot get pages, the least urgent requests are retracted and resume later by
recompute. When steps run, and when finished requests' pages may be reused, is the loop's
business (`scheduler.py`): the policy releases them on `release_deferred()`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, FrozenSet, List, Tuple

from minisgl.kvcache import MatchResult, PageAllocator, create_cache_manager
from minisgl.kvcache.window import DECODE_AHEAD_TOKENS, HybridPageAllocator, window_match_pages, window_row_pages
from minisgl.message.outputs import SchedulerStats  # crosses processes as itself
from minisgl.sampling_params import InvalidRequest, check_context, check_token_ids
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.grammar_compile import CompileJob, CompilePool
from minisgl.scheduler.plan import NewRow, PromptLogprobs, StepPlan, Write
from minisgl.scheduler.queue import make_queue, retraction_order
from minisgl.scheduler.request import SchedReq, Status, TokenOutput, UserRequest
from minisgl.scheduler.spec_ngram import DraftLength, NgramIndex
from minisgl.scheduler.spec_proposer import NgramProposer, Proposer, within_grammar
from minisgl.scheduler.step_budget import StepBudget
from minisgl.utils.logger import init_logger
from minisgl.utils.misc import div_ceil

logger = init_logger(__name__)
_FINISHED = Status.FINISHED  # (read per row per step)
PROMPT_LOGPROB_CHUNK = 512  # prompt tokens per step of a request that wants prompt logprobs
# Optimistic admission ignores the estimate while this share of the pool stays free after the
# admission (and the planned decode step's pages): an estimate that is still far from what
# requests use (0.5 of a whole context for a chat without max_tokens) must not keep requests
# waiting beside an empty pool. A wrong guess costs a retraction once the pool is full.
FREE_POOL_SHARE = 0.5


class NewTokenEstimate:
    """Optimistic admission's estimate: the share of its remaining max_tokens a running request
    is expected to still generate. It starts at init_new_token_ratio and moves each step (time
    constant new_token_ratio_decay_steps) toward 1.25x the share that recently finished requests
    used (toward min_new_token_ratio before any finished): optimism grows until a retraction
    says stop, which raises it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.ratio = config.init_new_token_ratio
        # shares of their max_tokens that recently finished requests used: the estimate's target
        self._shares: Deque[float] = deque(maxlen=64)
        self._target = config.min_new_token_ratio

    @property
    def effective(self) -> float:
        return min(1.0, self.ratio * self.config.schedule_conservativeness)

    def step(self) -> None:
        keep = 1.0 - 1.0 / self.config.new_token_ratio_decay_steps
        self.ratio = self._target + (self.ratio - self._target) * keep

    def finished(self, share: float) -> None:
        shares = self._shares
        shares.append(share)
        self._target = min(1.0, max(self.config.min_new_token_ratio, 1.25 * sum(shares) / len(shares)))

    def retracted(self) -> None:
        self.ratio = min(1.0, self.ratio * 1.5 + 0.05)


@dataclass
class _Pick:
    reqs: List[SchedReq]
    phase: str
    num_decode_rows: int = 0
    drafts: List[List[int]] | None = None  # a verify step: per row its draft tokens ([]: none)


@dataclass(frozen=True)
class Limits:
    """What the policy must know of the engine."""

    num_pages: int
    max_seq_len: int
    vocab_size: int
    eos_ids: FrozenSet[int]
    # the embed task's pooling method (engine/pooling.py), None for the generate task: every
    # request is then prefilled once, its vector returned, and it finishes (no decode)
    pooling: str | None = None
    # the most tokens a step may feed and still run on the engine's fast runner (the CPU decode
    # loop's rows, engine/cpu_decode.py); None: no such bound. Verify steps stay within it.
    fast_step_tokens: int | None = None
    # a model with sliding layers (kvcache/window.py): the window pool's pages (the dummy page's
    # twin not counted) and the longest sliding window; None: one pool, every layer every token
    window_pages: int | None = None
    window: int | None = None


class Policy:
    def __init__(
        self,
        config: SchedulerConfig,
        limits: Limits,
        *,
        share_rows: bool = False,
        on_grammar: Callable[[Any], None] | None = None,
        on_cpu: bool = False,
    ) -> None:
        self.config = config
        self.speculative = config.speculative_algorithm
        if self.speculative is not None and limits.pooling is not None:
            raise ValueError(f"speculative_algorithm={self.speculative!r} needs the generate task (this model runs the embed task)")
        self._spec_proposed = self._spec_accepted = self._spec_rows = 0
        # the n-gram lookup (NgramIndex looked up at each use: the tests swap in an oracle); a
        # scheduler over an engine replaces it with the draft model's (scheduler/spec_draft.py)
        self.proposer: Proposer = NgramProposer(lambda: NgramIndex(config.speculative_ngram_min, config.speculative_ngram_max))
        # the prompt-token cap of steps beside decoding streams: max_step_ms, by default on a CPU only
        target = config.max_step_ms
        self.step_budget = StepBudget(target or None) if (target or (target is None and on_cpu)) else None
        self._on_grammar = on_grammar  # told the GrammarBackend when the first grammar arrives
        self.page_size = config.page_size
        self.alloc_ahead = max(0, DECODE_AHEAD_TOKENS - self.page_size)  # decode tokens of pages allocated ahead
        self.max_seq_len = limits.max_seq_len
        self.vocab_size = limits.vocab_size
        self.eos_ids = set(limits.eos_ids)
        self.pooling = limits.pooling
        self.fast_step_tokens = limits.fast_step_tokens
        self.window = limits.window if limits.window_pages is not None else None
        self.allocator = PageAllocator(limits.num_pages)
        # Window pages (kvcache/window.py): each admitted request claims what it may read at once
        # (`_window_claim`); admission keeps the claims within the pool, less a step's chunks.
        # A window pool as large as the main pool cannot run short: no claims then.
        self._window_checked = False
        self._window_claimed = 0  # window pages claimed by the requests holding a row
        self._window_left = 0  # this step's window pages not yet spoken for (`_window_take`)
        self._window_exact = False  # whether _window_left counts the reclaimable ones too
        if limits.window_pages is not None:
            assert limits.window is not None, "a window pool needs its window"
            self.allocator = HybridPageAllocator(limits.num_pages, limits.window_pages)
            self._window_checked = limits.window_pages < limits.num_pages
            # (the engine sized the pool with the same bound: engine._determine_num_pages)
            ahead_tokens = DECODE_AHEAD_TOKENS + config.speculative_num_tokens
            self._window_ahead_pages = div_ceil(ahead_tokens, self.page_size) + 1
            self._window_row_pages = window_row_pages(limits.window, self.page_size, ahead_tokens)
            self._window_step_pages = div_ceil(config.max_extend_tokens, self.page_size)
        self.cache = create_cache_manager(config.cache_type, self.page_size)
        self.free_rows: List[int] = list(range(config.max_running_req - 1, -1, -1))
        self._group_rows: Dict[int, int] = {}  # group -> table rows its requests hold (fair admission)
        self.waiting = make_queue(config.schedule_policy)  # new and retracted requests
        self._queued: Dict[int, SchedReq] = {}  # uid -> a new request in `waiting`
        self.active: Dict[int, SchedReq] = {}  # admitted, not yet released (retracted ones too)
        self._prefilling: Dict[int, SchedReq] = {}  # in order of admission
        self._running: Dict[int, SchedReq] = {}  # decoding, in order of prefill completion
        self.estimate = NewTokenEstimate(config)
        self._decode_need = 0  # pages the planned step's decode rows need (set by _schedule)
        self._admit_counter = 0
        self._retractions = 0
        self._mixed_steps = 0
        self._peak_running = 0
        self._reserved = 0  # pages promised to admitted requests, not yet allocated
        self._deferred: List[SchedReq] = []  # finished; released once no in-flight step can touch them
        # page-table / token-pool writes queued for the next plan
        self._pt_writes: List[Write] = []
        self._tp_writes: List[Write] = []
        # what a runner with its own request objects (a TP follower) needs besides the rows
        self._share_rows = share_rows
        self._new_rows: List[NewRow] = []
        self._releases: List[int] = []
        self._history: Dict[int, List[int]] = {}
        self._last_phase = "decode"
        self._early: List[TokenOutput] = []  # outputs produced outside a step (aborts)
        self._prompt_tokens = self._hit_tokens = self._generated = 0
        self._steps = {"prefill": 0, "decode": 0}
        self._num_penalized = 0  # admitted requests whose sampling needs the host-side history
        self._num_constrained = 0  # admitted requests with a grammar (their next mask needs the last token)
        self.grammar: Any = None  # GrammarBackend, created by the first request with a grammar
        self._grammar_lock = threading.Lock()  # the backend is created on a compile thread
        self._compile_pool: CompilePool | None = None
        # uid -> (request, its compile): not queued yet, holding no row and no pages
        self._compiling: Dict[int, tuple[SchedReq, CompileJob]] = {}
        self._rejected: List[tuple[int, InvalidRequest]] = []  # failed compiles, for take_rejected()

    # ---- views -------------------------------------------------------------------------------
    @property
    def running(self) -> List[SchedReq]:
        return list(self._running.values())

    @property
    def prefilling(self) -> List[SchedReq]:
        return list(self._prefilling.values())

    @property
    def retracted(self) -> List[SchedReq]:
        return self.waiting.retracted

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, req: UserRequest, compile_grammar: bool = True) -> None:
        """Raise InvalidRequest (a ValueError) naming what is wrong with the request (nothing is
        changed). The same checks as the API server's, so the offline API and the server agree.
        The grammar is compiled here (blocking) unless `compile_grammar` is off: `add_request`
        compiles it off the loop instead."""
        if req.uid in self._queued or req.uid in self.active:
            raise InvalidRequest(f"request uid {req.uid} is already in use")
        check_token_ids(req.input_ids, self.vocab_size, "input_ids")
        # max_tokens against the context: check_context refuses (strict) or clips (a default)
        req.sampling_params.validate(self.vocab_size)
        if req.sampling_params.priority != 0 and self.config.schedule_policy != "priority":
            raise InvalidRequest(
                "priority scheduling is off: start the server with --schedule-policy priority to use 'priority'", param="priority"
            )
        if compile_grammar and req.sampling_params.grammar is not None:
            # a bad grammar is a 400 now; the compile stays in the pool's cache for add_request
            job = self.compile_pool().submit(req.sampling_params.grammar)
            self.grammar_submitted(job)
            job.wait()
        params = req.sampling_params
        check_context(len(req.input_ids), params.max_tokens, self.max_seq_len, strict=req.strict_max_tokens, min_tokens=params.min_tokens)

    def _grammar_backend(self) -> Any:
        with self._grammar_lock:  # (the first compile thread may be creating it)
            if self.grammar is None:
                from minisgl.scheduler.grammar import GrammarBackend
                from minisgl.utils.hf import load_tokenizer

                grammar = GrammarBackend(load_tokenizer(self.config.model_path), self.vocab_size)
                if self._on_grammar is not None:
                    self._on_grammar(grammar)
                self.grammar = grammar
            return self.grammar

    def compile_pool(self) -> CompilePool:
        """The threads that compile grammars (created by the first request with a grammar)."""
        if self._compile_pool is None:
            self._compile_pool = CompilePool(lambda spec: self._grammar_backend().compile(spec))
        return self._compile_pool

    def grammar_submitted(self, job: CompileJob) -> None:
        """Hook: a request's grammar started compiling (TP rank 0 tells its followers)."""

    def add_request(self, user: UserRequest) -> None:
        """Queue a request. One with a grammar waits, holding nothing, until its grammar is
        compiled (off the loop); a grammar that fails to compile ends it with the 400 that
        `take_rejected` returns."""
        self.validate(user, compile_grammar=False)
        params = user.sampling_params
        # an embedding never decodes: room for the one step past its prompt, as every request
        max_tokens = 1 if self.pooling is not None else params.max_tokens
        output_len = check_context(len(user.input_ids), max_tokens, self.max_seq_len, strict=False)
        req = SchedReq(user, output_len)
        req.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            req.stop_ids |= self.eos_ids
        self._queued[req.uid] = req
        if params.grammar is not None:
            job = self.compile_pool().submit(params.grammar)
            self._compiling[req.uid] = (req, job)
            self.grammar_submitted(job)
            self._poll_compiles()  # a cached grammar is ready at once
        else:
            self.waiting.push(req)

    def _poll_compiles(self) -> None:
        """Requests whose grammar compiled join the queue (with their matcher); a failed or
        timed-out compile ends its request (`take_rejected`)."""
        if not self._compiling:
            return
        now = time.monotonic()
        for uid, (req, job) in list(self._compiling.items()):
            ready, outcome = job.outcome(now)
            if not ready:
                continue
            del self._compiling[uid]
            if isinstance(outcome, InvalidRequest):
                del self._queued[uid]
                req.status, req.finish_reason = Status.FINISHED, "error"
                self._rejected.append((uid, outcome))
                logger.info("request %d: grammar refused after %.2f s: %s", uid, job.seconds, outcome.message)
            else:
                req.grammar_matcher = self._grammar_backend().xgr.GrammarMatcher(outcome)
                self.waiting.push(req)

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Nothing to run but grammars compiling: block until one is done (bounded), not spin."""
        if self._compiling and self._compile_pool is not None:
            self._compile_pool.wait_any([job for _, job in self._compiling.values()], timeout_s)
        self._poll_compiles()

    @property
    def compiling(self) -> Dict[int, CompileJob]:
        """uid -> its grammar's compile, for the requests waiting on one."""
        return {uid: job for uid, (_, job) in self._compiling.items()}

    def take_rejected(self) -> List[tuple[int, InvalidRequest]]:
        """Requests refused after `add_request` returned (their grammar did not compile): each
        gets the 400 it would have got at once; nothing of theirs was admitted."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def abort(self, uid: int) -> bool:
        """Stop a request wherever it is; its pages are freed. Returns whether it was found."""
        req = self._queued.pop(uid, None)
        if req is not None:  # never admitted: nothing to release
            if self._compiling.pop(uid, None) is None:  # (a compile still running is cached for others)
                self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"
            self._early.append(TokenOutput(uid, None, True, "abort", prompt_tokens=req.prompt_len))
            return True
        req = self.active.get(uid)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        self._early.append(TokenOutput(uid, None, True, "abort", prompt_tokens=req.prompt_len))
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self._prefilling or self._running or self._early or self._compiling)

    def take_early(self) -> List[TokenOutput]:
        """Outputs produced outside a step (abort notices)."""
        early, self._early = self._early, []
        return early

    # ---- scheduling --------------------------------------------------------------------------
    def decodable(self) -> tuple[List[SchedReq], int]:
        """The requests that can decode next, and the pages that step needs beyond theirs
        (0 under worst-case admission: their reservations cover it)."""
        decodable = [r for r in self._running.values() if r.can_decode]
        need = self._decode_page_need(decodable) if self.config.admission == "optimistic" else 0
        return decodable, need

    def plan_step(self, decodable: List[SchedReq], need: int, in_flight: StepPlan | None) -> StepPlan | None:
        """The next step (None: nothing to run). `decodable, need` come from `decodable()`; a
        step that needs retraction must be planned with no step in flight (its pages are
        freed at once)."""
        self._poll_compiles()
        pick = self._schedule(decodable, need, in_flight)
        return self._plan(pick) if pick is not None else None

    def _schedule(self, decodable: List[SchedReq], need: int, in_flight: StepPlan | None) -> _Pick | None:
        if self.must_retract(decodable, need):
            assert in_flight is None, "retraction with a step in flight"
            decodable, need = self._retract_until_fits(decodable, need)
        self._decode_need = need
        if self._window_checked:  # (the free ones first; `_window_take` adds the reclaimable ones when short)
            self._window_left = self._window_pool.num_free - self._decode_page_need(decodable)
            self._window_exact = False
        want_prefill = bool(self.waiting or self._prefilling)
        if want_prefill and decodable and self.config.mixed_batches:
            # One batch: every decode row (one token each) plus prefill chunks in the rest of
            # the token budget, so no stream waits for a whole prefill step.
            pick = self._schedule_prefill(decodable, in_flight)
            if pick is not None:
                self._last_phase = "prefill"
                self._mixed_steps += 1
                self.estimate.step()
                return pick
        elif want_prefill and (not decodable or self._last_phase == "decode"):
            # Without mixing, alternate: a decode step never waits more than one
            # (budget-bounded) prefill step, and prefills still make progress every other step.
            pick = self._schedule_prefill([], in_flight)
            if pick is not None:
                self._last_phase = "prefill"
                return pick
        if decodable:
            self._last_phase = "decode"
            self.estimate.step()
            return self._decode_pick(decodable)
        return None

    def _decode_pick(self, reqs: List[SchedReq]) -> _Pick:
        """A decode step, or with speculation a verify step when some row has a draft: each row
        with one is an extend of its last token and the drafts, the others one-token extends."""
        if self.speculative is None:
            return _Pick(reqs, "decode")
        cfg = self.config
        optimistic = cfg.admission == "optimistic"
        spare = self.available_pages() - self._decode_need  # (worst case: reservations cover max_tokens)
        # the fast runner's capacity (the CPU decode loop's rows): a verify step past it would
        # run on the module path and cost more than the drafts save; every row feeds one token
        room = None if self.fast_step_tokens is None else self.fast_step_tokens - len(reqs)
        proposer = self.proposer
        drafts: List[List[int]] = []
        asked: List[int] = []  # a batched proposer: each row's length, asked in one call
        for req in reqs:
            draft: List[int] = []
            # room for the drafts and the token after them within max_tokens
            k = min(self._draft_length(req).want(), req.max_device_len - req.device_len - 1)
            if room is not None:
                k = min(k, room)
            if not (k > 0 and _can_speculate(req) and len(req.token_ids) == req.device_len):
                k = 0
            if proposer.batched:
                # the caps hold for the asked length (the rows draft together, after this loop)
                if k and (optimistic or self._window_checked):
                    extra = self._extra_pages(req, k)
                    if not self._draft_fits(extra, spare if optimistic else extra):
                        k = 0
                    elif optimistic:
                        spare -= extra
                if room is not None:
                    room -= k
                asked.append(k)
                continue
            if k > 0:
                draft = proposer.propose([req], [k], self.grammar)[0]
                if req.grammar_matcher is not None:
                    draft = within_grammar(req.grammar_matcher, draft)
                if room is not None:
                    room -= len(draft)
            if draft and (optimistic or self._window_checked):
                extra = self._extra_pages(req, len(draft))
                if not self._draft_fits(extra, spare if optimistic else extra):
                    draft = []
                elif optimistic:
                    spare -= extra
            drafts.append(draft)
        if proposer.batched:
            drafts = proposer.propose(reqs, asked, self.grammar) if any(asked) else [[] for _ in reqs]
            drafts = [within_grammar(r.grammar_matcher, d) if d and r.grammar_matcher is not None else d for r, d in zip(reqs, drafts)]
        if not any(drafts):
            return _Pick(reqs, "decode")
        return _Pick(reqs, "prefill", drafts=drafts)

    def _draft_fits(self, extra: int, spare: int) -> bool:
        """Whether a verify row's `extra` pages fit the main pool's `spare` and the window
        ledger; if so they are counted in both."""
        if extra > spare or (self._window_checked and not self._window_take(extra)):
            return False
        if self.config.admission == "optimistic":
            self._decode_need += extra
        return True

    def _extra_pages(self, req: SchedReq, num_drafts: int) -> int:
        """Pages a verify row of `num_drafts` drafts needs beyond what its decode step needs."""
        ps = self.page_size
        have = max(len(req.pages), div_ceil(req.device_len, ps))
        return max(0, div_ceil(req.device_len + num_drafts, ps) - have)

    def _draft_length(self, req: SchedReq) -> DraftLength:
        """A speculating request's draft length, made on first use."""
        if req.spec is None:
            req.spec = DraftLength(self.config.speculative_num_tokens)
        return req.spec

    # ---- admission and retraction ------------------------------------------------------------
    def available_pages(self) -> int:
        return self.allocator.num_free + self.cache.evictable_pages - self._reserved

    @property
    def effective_new_token_ratio(self) -> float:
        """The share of its remaining max_tokens a running request is expected to generate."""
        return self.estimate.effective

    def _future_pages(self, length: int, remaining: int, held: int) -> int:
        """Pages a request of `length` tokens holding `held` pages is expected to still need."""
        expected = length + math.ceil(max(0, remaining) * self.effective_new_token_ratio)
        return max(0, div_ceil(expected, self.page_size) - held)

    def _expected_decode_pages(self) -> tuple[int, int]:
        """What admitted requests are expected to still take from the pool while decoding: in
        all, and the part of it that groups holding several rows expect (fair admission)."""
        total = crowd = 0
        rows = self._group_rows
        for r in self._running.values():
            pages = self._future_pages(r.device_len, r.output_len - r.num_output, len(r.pages))
            total += pages
            crowd += pages if rows.get(r.group, 0) > 1 else 0
        for r in self._prefilling.values():
            pages = self._future_pages(r.prefill_len, r.output_len - r.num_output, len(r.pages) + r.reserved_pages)
            total += pages
            crowd += pages if rows.get(r.group, 0) > 1 else 0
        return total, crowd

    def _decode_page_need(self, reqs: List[SchedReq]) -> int:
        ps = self.page_size
        return sum(max(0, div_ceil(r.device_len, ps) - len(r.pages)) for r in reqs)

    def must_retract(self, decodable: List[SchedReq], need: int) -> bool:
        """Whether the decode step of `decodable` (needing `need` pages beyond its reservations,
        `decodable()`) cannot get its main pages, or their window pages (a decoder past its
        window claim, kvcache/window.py), without retracting some of them."""
        if need > self.available_pages():
            return True
        return self._window_checked and self._window_short(self._decode_page_need(decodable))

    def _retract_until_fits(self, decodable: List[SchedReq], need: int) -> tuple[List[SchedReq], int]:
        """Take pages back from the least urgent decoders until this decode step's `need`
        fits, and its window pages; returns who stays and what they need (no step is in flight:
        freed pages are unused)."""
        keep = sorted(decodable, key=lambda r: retraction_order(r, self._group_rows))  # the first to go last
        while keep and self.must_retract(keep, need):
            # Everyone may go: prefilling requests hold reserved pages and always progress, and
            # the retracted resume (from the front of the queue) as pages return.
            victim = keep.pop()
            need -= self._decode_page_need([victim])
            self._retract(victim)
        self.estimate.retracted()
        return keep, need

    def _retract(self, req: SchedReq) -> None:
        """Return a decoding request's row and pages (its KV goes to the prefix cache, so a
        resume finds what survives) and queue it to resume before any new request."""
        del self._running[req.uid]
        self._release_pages(req)
        req.num_retractions += 1
        self._retractions += 1
        req.status = Status.RETRACTED
        self.waiting.requeue(req)
        logger.debug("retracted request %d at %d tokens", req.uid, len(req.token_ids))

    def _fits(self, need_now: int, future: int, expected: int) -> bool:
        available = self.available_pages()
        if self.config.admission != "optimistic":
            return need_now <= available
        if need_now + future + expected <= available:
            return True
        # the pool is mostly free: what the step really takes must leave the headroom
        headroom = math.ceil(FREE_POOL_SHARE * self.allocator.num_pages)
        return need_now + self._decode_need + headroom <= available

    def _schedule_prefill(self, decoding: List[SchedReq], in_flight: StepPlan | None) -> _Pick | None:
        """A prefill step: chunks of admitted prompts, then resumed and new requests, within
        the token budget; `decoding` rows (one token each) go first when mixing."""
        budget = self.config.max_extend_tokens - len(decoding)
        if self.step_budget is not None and self._running:  # streams wait on this step
            budget = min(budget, self.step_budget.prompt_tokens())
        if budget <= 0:
            return None
        ps = self.page_size
        reqs: List[SchedReq] = []
        for req in self._prefilling.values():
            if budget <= 0:
                break
            budget = self._add_chunk(req, budget, reqs)
        optimistic = self.config.admission == "optimistic"
        # (only when something may be admitted: it walks every admitted request)
        expected, crowd = self._expected_decode_pages() if optimistic and self.waiting else (0, 0)
        flying = in_flight.reqs if in_flight is not None else []
        while budget > 0 and self.free_rows:
            head = self.waiting.peek()
            if head is None:
                break
            req = head
            if req.status is Status.RETRACTED:  # resume: recompute every token but a cached prefix
                if any(r is req for r in flying):
                    break  # (after a failed step) its last token is still on the way: resume after it
                ids = req.token_ids
                match = self._match(ids[: len(ids) - 1])
                need = div_ceil(len(ids), ps) - match.num_pages
                future = self._future_pages(len(ids), req.output_len - req.num_output, div_ceil(len(ids), ps))
            else:
                params = req.sampling_params
                # a request that wants its prompt's logprobs needs every prompt token's logits, and
                # mean/cls pooling every row from position 0: no cache hit
                every_row = params.prompt_logprobs is not None or self.pooling in ("mean", "cls")
                match = self._match(req.token_ids[: 0 if every_row else req.prompt_len - 1])
                prompt_pages = div_ceil(req.prompt_len, ps)
                if optimistic:  # the prompt is reserved; its decoding is an estimate
                    need = prompt_pages - match.num_pages
                    future = self._future_pages(req.prompt_len, req.output_len, prompt_pages)
                else:  # worst case: prompt and every token it may generate
                    need = div_ceil(req.prompt_len + req.output_len, ps) - match.num_pages
                    future = 0
            # Fair admission (with the queue's round-robin over groups): the first request of a
            # group does not wait behind the estimated decoding of groups that hold several
            # rows (a client's n=64 choices; their real pages still count), and the last free
            # row is kept for it. Its estimate and single requests' estimates still count.
            new_group = req.status is Status.WAITING and req.group not in self._group_rows
            if not new_group and len(self.free_rows) == 1 and req.status is Status.WAITING:
                self.cache.unlock(match.handle)
                break
            if not self._fits(need, future, expected - crowd if new_group else expected):
                self.cache.unlock(match.handle)
                break  # wait for running requests to finish and return pages
            claim = self._window_claim(req) if self._window_checked else 0
            if claim and not self._window_admits(req, match, claim, budget):
                self.cache.unlock(match.handle)
                break  # wait for admitted requests to give window pages back
            self.waiting.pop()
            self._group_rows[req.group] = self._group_rows.get(req.group, 0) + 1
            first = req.status is Status.WAITING
            if first:
                self._start(req)
            req.admit(self.free_rows.pop(), match, ps)
            if first:
                self._hit_tokens += req.cached_len
            self._admitted(req, need)
            req.window_claim = claim
            self._window_claimed += claim
            expected += future
            crowd += future if self._group_rows[req.group] > 1 else 0
            budget = self._add_chunk(req, budget, reqs)
        if not reqs:
            return None
        running = len(self._running) + len(self._prefilling)
        self._peak_running = max(self._peak_running, running)
        for r in decoding:
            r.trusted_len = r.cached_len  # what survives if this step fails (see _recover)
        return _Pick(decoding + reqs, "prefill", len(decoding))

    def _match(self, ids: List[int]) -> MatchResult:
        """The prefix cache's match, cut (with window pages) to the last point whose preceding
        window still has the sliding layers' K/V (kvcache/window.py); the handle still pins the
        whole path matched, released as usual."""
        match = self.cache.match_prefix(ids)
        allocator = self.allocator
        if not isinstance(allocator, HybridPageAllocator) or not match.pages:
            return match
        assert self.window is not None
        k = window_match_pages(allocator.has_window(match.pages), self.window, self.page_size)
        if k == 0:
            self.cache.unlock(match.handle)
            return MatchResult(None, [])
        return MatchResult(match.handle, match.pages[:k])

    def _start(self, req: SchedReq) -> None:
        """A new request's first admission: it becomes active."""
        del self._queued[req.uid]
        self.active[req.uid] = req
        params = req.sampling_params
        self._num_penalized += params.has_penalties
        if params.grammar is not None:
            if req.grammar_matcher is None:  # (set when its compile finished)
                req.grammar_matcher = self._grammar_backend().matcher(params.grammar)
            self._num_constrained += 1
        self._prompt_tokens += req.prompt_len
        if self._share_rows:
            self._new_rows.append(NewRow(req.uid, req.token_ids[: req.prompt_len], params, sorted(req.stop_ids)))

    def _admitted(self, req: SchedReq, reserve: int) -> None:
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        req.reserved_pages = reserve
        self._reserved += reserve
        self._write_prompt(req)
        self._prefilling[req.uid] = req

    def _add_chunk(self, req: SchedReq, budget: int, reqs: List[SchedReq]) -> int:
        chunk = min(req.prefill_len - req.cached_len, budget)
        if _wants_prompt_logprobs(req):
            # every position of its chunk goes through the LM head: short chunks, so the
            # others' decode rows run between them (their logprobs are the same either way)
            chunk = min(chunk, PROMPT_LOGPROB_CHUNK)
        if self._window_checked:
            chunk = self._window_chunk(req, chunk)
            if chunk == 0:
                return budget  # its next chunk waits for window pages (decoders give theirs back)
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
        allocator = self.allocator
        if isinstance(allocator, HybridPageAllocator) and allocator.num_window_free < need:
            self._reclaim_windows(allocator, need - allocator.num_window_free)
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

    # ---- planning ----------------------------------------------------------------------------
    def _plan(self, pick: _Pick) -> StepPlan:
        reqs = pick.reqs
        decode = pick.phase == "decode"
        plan = StepPlan(pick.phase, [], [], [], [], [], pick.num_decode_rows, reqs=reqs)
        if pick.drafts is not None:  # the drafts follow each row's last token in the token pool
            plan.drafts = pick.drafts
            plan.draft_probs = [self.proposer.draft_probs(r) if d else None for r, d in zip(reqs, pick.drafts)]
            for req, draft in zip(reqs, pick.drafts):
                if draft:
                    self._tp_writes.append((req.table_idx, req.device_len, draft))
                    req.device_len += len(draft)
        ps = self.page_size
        ahead = self.alloc_ahead
        if self.config.admission == "optimistic" and ahead:
            # ahead of need only while the pool has room to spare for it
            spare = self.available_pages() - self._decode_need
            if spare < 2 * len(reqs) * div_ceil(ahead, ps):
                ahead = 0
        if isinstance(self.allocator, HybridPageAllocator):
            self._drop_windows(self.allocator, reqs)
            if self._window_checked and self._window_left < len(reqs) * self._window_ahead_pages:
                ahead = 0  # (pages ahead are an optimization: only from window pages left over)
        for req in reqs:
            if req.device_len > len(req.pages) * ps:
                # Allocate a few steps ahead: with page_size 1 a decode step would otherwise
                # allocate, and write the page table, for every request every step.
                upto = min(req.device_len + ahead, req.max_device_len) if decode or req.prefill_done else req.device_len
                self._alloc_pages(req, upto)
        plan.uids = [r.uid for r in reqs]
        plan.rows = [r.table_idx for r in reqs]
        plan.ends = [r.device_len for r in reqs]
        if decode:
            plan.starts = [e - 1 for e in plan.ends]
            plan.emits = [True] * len(reqs)
        else:
            plan.starts = [r.cached_len for r in reqs]
            # a request emits a real token once its whole prompt (or resume) has KV
            plan.emits = [r.device_len >= r.prefill_len for r in reqs]
            plan.prompt_logprobs = None if plan.drafts else _prompt_logprob_plan(reqs)
        plan.page_writes, self._pt_writes = self._pt_writes, []
        if isinstance(self.allocator, HybridPageAllocator):
            plan.window_writes = self.allocator.take_writes()
        plan.token_writes, self._tp_writes = self._tp_writes, []
        if self._share_rows:
            plan.releases, self._releases = self._releases, []
            plan.new_rows, self._new_rows = self._new_rows, []
            plan.history, self._history = self._history, {}
        return plan

    def _window_dead(self, req: SchedReq) -> int:
        """Pages of `req` before this one are read by no query of its from the next step on:
        they lie wholly below the window before its last page boundary at or before cached_len
        (that window is kept for the prefix cache: a conversation continued from the cache finds
        it there)."""
        return self._window_dead_at(req.cached_len)

    def _window_dead_at(self, cached_len: int) -> int:
        assert self.window is not None
        ps = self.page_size
        return max(0, cached_len // ps * ps - self.window + 1) // ps

    def _reclaim_windows(self, allocator: HybridPageAllocator, short: int) -> None:
        """Free `short` window pages that no admitted request reads: cached pages' windows (the
        tails of cached prefixes, pinned or not) outside every admitted request's live window,
        the oldest first. There are always enough: the step's window ledger counted them
        (`_window_take`) before anything was allocated. Those prefixes then no longer match
        there (`_match` cuts)."""
        live = self._live_window_pages()
        victims = [p for p, w in enumerate(allocator.win_of) if w >= 0 and p not in live]
        assert len(victims) >= short, f"window pool: {short} pages short, {len(victims)} reclaimable"
        victims.sort(key=allocator.win_age.__getitem__)
        # an eighth of the pool at least: the scan walks every main page, so it should not run
        # again at the next allocation
        allocator.drop_window(victims[: max(short, allocator.window.num_pages // 8)])

    @property
    def _window_pool(self) -> PageAllocator:
        allocator = self.allocator
        assert isinstance(allocator, HybridPageAllocator), "no window pool"
        return allocator.window

    def _live_window_pages(self) -> set[int]:
        """The main pages whose window pages some admitted request reads (`_window_dead`)."""
        live: set[int] = set()
        for r in self.active.values():
            if r.holds_row:  # (finished ones awaiting release too: a step in flight may read them)
                live.update(r.pages[self._window_dead(r) :])
        return live

    def _window_available(self) -> int:
        """Window pages free, or held only where no admitted request reads them (own pages a
        window behind, cached prefixes' tails: `_drop_windows` / `_reclaim_windows` free those)."""
        pool = self._window_pool  # (checks that the allocator is the hybrid one)
        held = self.allocator.win_of  # type: ignore[attr-defined]
        return pool.num_pages - sum(held[p] >= 0 for p in self._live_window_pages())

    def _window_short(self, pages: int) -> bool:
        """Whether `pages` new window pages cannot be had now (the cheap test first)."""
        if pages <= self._window_pool.num_free:
            return False
        return pages > self._window_available()

    def _window_take(self, pages: int) -> bool:
        """Count `pages` against this step's window ledger, if they are there."""
        if pages > self._window_left and not self._window_exact:
            free = self._window_pool.num_free
            self._window_left += self._window_available() - free
            self._window_exact = True
        if pages > self._window_left:
            return False
        self._window_left -= pages
        return True

    def _window_claim(self, req: SchedReq) -> int:
        """The window pages `req` may read at once as it decodes (kvcache/window.py
        `window_row_pages`), its whole length's at most. Optimistic admission counts the pages
        of the length it is expected to reach (as `_future_pages`; pages ahead of need come from
        what is left over): a decoder past its claim takes window pages while some are left,
        and is retracted when none are (`must_retract`); worst-case admission never has to."""
        ps = self.page_size
        if self.config.admission != "optimistic":
            return min(self._window_row_pages, div_ceil(req.max_device_len, ps))
        return min(self._window_row_pages, self._future_pages(len(req.token_ids), req.output_len - req.num_output, 0))

    def _window_admits(self, req: SchedReq, match: MatchResult, claim: int, budget: int) -> bool:
        """Whether `req` (its cached prefix `match`) may be admitted beside the window pool's
        other claims (and one step's chunks, the sizing's share), and its first chunk's window
        pages, with its matched window tail, are there this step; the tail is counted if so
        (`_add_chunk` counts the chunk's)."""
        window_pages = self._window_pool.num_pages
        if self._window_claimed + claim + self._window_step_pages > window_pages:
            return False
        ps = self.page_size
        matched = match.num_pages
        tail = matched - self._window_dead_at(matched * ps)
        chunk = min(len(req.token_ids) - matched * ps, budget)
        first = tail + max(0, div_ceil(matched * ps + chunk, ps) - matched)
        if not self._window_take(first):
            return False
        self._window_left += first - tail  # (the chunk's pages are counted by _add_chunk)
        return True

    def _window_chunk(self, req: SchedReq, chunk: int) -> int:
        """`chunk`, or the part of it whose window pages are left this step (counted)."""
        ps = self.page_size
        have = len(req.pages)
        pages = max(0, div_ceil(req.cached_len + chunk, ps) - have)
        if not self._window_take(pages):
            chunk = max(0, min(chunk, (have + self._window_left) * ps - req.cached_len))
            pages = max(0, div_ceil(req.cached_len + chunk, ps) - have)
            taken = self._window_take(pages)
            assert taken
        return chunk

    def _drop_windows(self, allocator: HybridPageAllocator, reqs: List[SchedReq]) -> None:
        """Free the window pages of each request's own pages that no query of its reads from this
        step on (`_window_dead`; a step in flight may still read them: it finishes before this
        step writes into them, kvcache/window.py). Pages that came from the prefix cache stay
        (the cache's; `_reclaim_windows` frees theirs when no admitted request reads them)."""
        ps = self.page_size
        for req in reqs:
            dead = self._window_dead(req)
            own = req.matched_len // ps
            if dead > req.window_from:
                allocator.drop_window(req.pages[max(own, req.window_from) : dead])
                req.window_from = dead

    def launched(self, plan: StepPlan) -> None:
        """After the runner launched `plan` (its rows advanced by complete_one): where each
        prefilling request stands for the next plan."""
        if plan.drafts:  # a verify step: every row was decoding (consume rolls the lengths back)
            self._steps["decode"] += 1
            return
        self._steps[plan.phase] += 1
        if plan.is_prefill:
            reqs: List[SchedReq] = plan.reqs
            for i in range(plan.num_decode_rows, len(reqs)):  # a mixed step's decode rows are running already
                req = reqs[i]
                if not plan.emits[i]:
                    req.device_len = req.cached_len  # mid-prompt chunk: the next chunk continues here
                else:
                    del self._prefilling[req.uid]
                    self._running[req.uid] = req
                    req.status = Status.RUNNING

    def step_timed(self, plan: StepPlan, ms: float) -> None:
        """A launched step's measured time, launch to results (the step budget's input)."""
        if self.step_budget is None:
            return
        if plan.is_decode:
            self.step_budget.observe(len(plan.uids), 0, ms)
            return
        if plan.drafts:  # a verify step: decode rows, their drafts counted as prompt tokens
            self.step_budget.observe(len(plan.uids), sum(map(len, plan.drafts)), ms)
            return
        prompt_tokens = sum(plan.ends) - sum(plan.starts) - plan.num_decode_rows
        self.step_budget.observe(plan.num_decode_rows, prompt_tokens, ms)

    @property
    def must_sync(self) -> bool:
        """Penalties read every generated token on the host, and a grammar's next mask needs the
        last token: while an admitted request uses either, each step's results are read before
        the next is planned (a counter, not a per-step scan of the batch)."""
        return self._num_penalized > 0 or self._num_constrained > 0

    # ---- results -----------------------------------------------------------------------------
    def consume(self, plan: StepPlan, result: Any) -> List[TokenOutput]:
        """A launched step's host results (a runner.StepResult): tokens appended, stop
        conditions checked, prompt logprobs gathered."""
        if self.pooling is not None:  # the embed task: every step's results are vectors
            return self._consume_embeddings(plan, result.embeddings)
        tokens = result.tokens
        lps = result.logprobs
        verify = result.verify if plan.drafts else None
        plp = result.prompt_logprobs
        counts = plan.prompt_logprobs.counts if plp is not None and plan.prompt_logprobs is not None else None
        plp_at = 0
        outputs: List[TokenOutput] = []
        for i, (req, real) in enumerate(zip(plan.reqs, plan.emits)):
            n = counts[i] if counts is not None else 0
            if n:  # this chunk's prompt logprobs (rows in batch order)
                assert plp is not None
                k = req.sampling_params.prompt_logprobs or 0
                at = len(req.prompt_lp)  # logprobs so far = prompt position of the next one
                targets = req.token_ids[at + 1 : at + 1 + n]
                for j in range(n):
                    tops = list(zip(plp[2][plp_at + j][:k], plp[1][plp_at + j][:k]))
                    req.prompt_lp.append([targets[j], plp[0][plp_at + j], tops])
                plp_at += n
            if not real or req.status is _FINISHED:
                continue
            if verify is not None and plan.drafts[i]:
                row_lps = result.verify_logprobs[i] if result.verify_logprobs is not None else None
                outputs += self._accept_drafts(req, plan.starts[i], plan.drafts[i], verify[i], row_lps)
                continue
            outputs.append(self._emit(req, tokens[i], lps[i] if lps is not None else None))
        return outputs

    def _accept_drafts(
        self, req: SchedReq, start: int, drafts: List[int], targets: List[int], lps: List[Any] | None = None
    ) -> List[TokenOutput]:
        """Greedy acceptance of a verify row: the drafts the target agrees with, then the
        target's own token (at the first mismatch, or after every draft). Emitted one by one
        as a decode step would, so a stop condition cuts the run where it would have stopped."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        self._spec_rows += 1
        self._spec_proposed += len(drafts)
        self._spec_accepted += accepted
        self._draft_length(req).observe(len(drafts), accepted)
        # KV is sound for the fed last token and the accepted drafts; the rejected drafts'
        # slots are rewritten by the next steps (the pages stay the request's)
        req.cached_len = start + 1 + accepted
        req.device_len = req.cached_len + 1
        self.proposer.accepted(req)  # (a draft model's KV past the accepted tokens is rolled back too)
        # the pool holds a rejected draft there, or the sampler's token (a sampled row's bonus
        # token is the verify draw, not the sampler's)
        self._tp_writes.append((req.table_idx, req.cached_len, [targets[accepted]]))
        outputs: List[TokenOutput] = []
        for j, token in enumerate(targets[: accepted + 1]):
            outputs.append(self._emit(req, token, lps[j] if lps is not None else None))
            if req.finished:
                break
        return outputs

    def _emit(self, req: SchedReq, token: int, lp: Any) -> TokenOutput:
        """One generated token of a running request: appended, stop conditions checked."""
        share = self._share_rows
        req.append_token(token)
        self._generated += 1
        out = TokenOutput(req.uid, token, prompt_tokens=req.prompt_len, cached_tokens=req.num_cached_prompt)
        if req.sampling_params.prompt_logprobs is not None and req.num_output == 1:
            out.prompt_logprobs, req.prompt_lp = req.prompt_lp, []
        if lp is not None:
            out.logprob, out.top_logprobs = lp
        matcher = req.grammar_matcher
        if matcher is not None and not matcher.accept_token(token):
            logger.warning("request %d: token %d is outside its grammar", req.uid, token)
        if share and (matcher is not None or req.sampling_params.has_penalties):
            self._history.setdefault(req.uid, []).append(token)  # the followers' sampler reads it
        if token in req.stop_ids or (matcher is not None and matcher.is_terminated()):
            self._finish(req, "stop")
        elif req.num_output >= req.output_len:
            self._finish(req, "length")
        out.finished, out.finish_reason = req.finished, req.finish_reason
        return out

    def _consume_embeddings(self, plan: StepPlan, vectors: List[bytes | None]) -> List[TokenOutput]:
        """An embed step: each request whose prompt ended in it gets its vector and finishes."""
        outputs: List[TokenOutput] = []
        for req, vector in zip(plan.reqs, vectors):
            if vector is None or req.status is _FINISHED:  # a mid-prompt chunk, or aborted meanwhile
                continue
            self._finish(req, "stop")
            cached = req.num_cached_prompt
            outputs.append(TokenOutput(req.uid, None, True, "stop", prompt_tokens=req.prompt_len, cached_tokens=cached, embedding=vector))
        return outputs

    def _finish(self, req: SchedReq, reason: str) -> None:
        status = req.status
        if status is Status.RUNNING:
            del self._running[req.uid]
        elif status is Status.PREFILLING:
            del self._prefilling[req.uid]
        elif status is Status.RETRACTED:
            self.waiting.remove(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        if reason in ("stop", "length") and req.output_len > 0 and self.pooling is None:
            self.estimate.finished(req.num_output / req.output_len)
        self._deferred.append(req)

    def fail(self, plans: List[StepPlan]) -> List[int]:
        """After a failed step (the device idle): end the requests of `plans`; decode rows of a
        failed mixed step resume by recompute instead. Returns the ended uids."""
        self._pt_writes.clear()
        self._tp_writes.clear()
        failed: List[int] = []
        for plan in plans:
            reqs: List[SchedReq] = plan.reqs
            for i, req in enumerate(reqs):
                if req.finished or self.active.get(req.uid) is not req:
                    continue
                if i < plan.num_decode_rows and req.status is Status.RUNNING:
                    # A decode row that rode along with a failed prefill: its KV up to this
                    # step is sound, so it resumes by recompute instead of failing with it.
                    req.cached_len = req.trusted_len
                    req.device_len = len(req.token_ids)
                    self._retract(req)
                    continue
                self._finish(req, "error")
                req.kv_trusted = False
                failed.append(req.uid)
        self.release_deferred()
        return failed

    def release_deferred(self) -> None:
        """Release the requests that finished: call when no step in flight may use their pages."""
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
        if self._share_rows:
            self._releases.append(req.uid)
            self._history.pop(req.uid, None)

    def _release_pages(self, req: SchedReq) -> None:
        """Return a request's row and pages; its full pages go to the prefix cache (after a
        failed step only the prefix it found there: its own KV cannot be trusted)."""
        self.proposer.release(req)  # (finished, aborted, retracted or failed: its draft KV too)
        if not req.holds_row:  # released when it was retracted
            return
        known = min(req.cached_len, len(req.token_ids)) if req.kv_trusted else req.matched_len
        full = min(known // self.page_size, len(req.pages))
        ids = req.token_ids[: full * self.page_size]
        to_free, _ = self.cache.insert(ids, req.pages[:full])
        to_free += req.pages[full:]
        self.cache.unlock(req.cache_handle)
        req.cache_handle = None
        self.allocator.free(to_free)
        self._window_claimed -= req.window_claim
        req.window_claim = 0
        self._reserved -= req.reserved_pages
        req.reserved_pages = 0
        req.pages = []
        self.free_rows.append(req.table_idx)
        req.table_idx = -1
        held = self._group_rows.pop(req.group) - 1
        if held:
            self._group_rows[req.group] = held

    # ---- introspection -----------------------------------------------------------------------
    def load(self) -> Tuple[int, int]:
        """(running, waiting) as `stats()` counts them: admitted requests (prefilling or decoding),
        and queued ones (a grammar compiling counts as waiting). Cheap: asked every step."""
        return len(self._running) + len(self._prefilling), len(self.waiting) + len(self._compiling)

    def stats(self) -> SchedulerStats:
        running, waiting = self.load()
        allocator = self.allocator
        window = allocator.window.num_pages if isinstance(allocator, HybridPageAllocator) else 0
        return SchedulerStats(
            num_running=running,
            num_waiting=waiting,
            total_pages=self.allocator.num_pages,
            free_pages=self.allocator.num_free + self.cache.evictable_pages,
            cached_pages=self.cache.cached_pages,
            window_total_pages=window,
            window_free_pages=self._window_available() if window else 0,
            prompt_tokens=self._prompt_tokens,
            cache_hit_tokens=self._hit_tokens,
            generated_tokens=self._generated,
            prefill_steps=self._steps["prefill"],
            decode_steps=self._steps["decode"],
            mixed_steps=self._mixed_steps,
            num_retracted=self.waiting.num_retracted,
            retractions=self._retractions,
            peak_running=self._peak_running,
            new_token_ratio=self.effective_new_token_ratio,
            spec_proposed_tokens=self._spec_proposed,
            spec_accepted_tokens=self._spec_accepted,
            spec_verify_rows=self._spec_rows,
        )

    def check_invariants(self) -> None:
        """When idle: every page is free or held unpinned by the cache, every row is free."""
        assert not self.has_work(), "check_invariants() needs an idle policy"
        assert not self.active and not self._deferred, f"requests still hold resources: {list(self.active)}"
        total = self.allocator.num_pages
        assert self.allocator.num_free + self.cache.cached_pages == total, (
            f"page leak: {self.allocator.num_free} free + {self.cache.cached_pages} cached != {total}"
        )
        assert self.cache.evictable_pages == self.cache.cached_pages, "a cached page is still pinned"
        assert len(self.free_rows) == self.config.max_running_req, "a table row leaked"
        assert not self._group_rows, f"rows still counted for groups {self._group_rows}"
        assert len(set(self.allocator._free)) == self.allocator.num_free, "a page was freed twice"
        allocator = self.allocator
        if isinstance(allocator, HybridPageAllocator):  # window pages: free, or held by a cached page
            held = [w for w in allocator.win_of if w >= 0]
            window = allocator.window
            assert window.num_free + len(held) == window.num_pages, (
                f"window page leak: {window.num_free} free + {len(held)} held by cached pages != {window.num_pages}"
            )
            assert len(set(window._free) | set(held)) == window.num_pages, "a window page was freed twice or is both free and held"
            free = set(allocator._free)
            assert not any(allocator.win_of[p] >= 0 for p in free), "a free page still holds a window page"
        assert self._reserved == 0, f"{self._reserved} pages still reserved"
        assert self._window_claimed == 0, f"{self._window_claimed} window pages still claimed"
        assert self._num_penalized == 0, "a finished request is still counted as using penalties"
        assert self._num_constrained == 0, "a finished request is still counted as constrained"
        self.proposer.check_idle()

    def reset_prefix_cache(self) -> int:
        """Drop every unpinned cached page; returns how many were freed."""
        freed = self.cache.reset()
        self.allocator.free(freed)
        return len(freed)


def _can_speculate(req: SchedReq) -> bool:
    """Verification (engine/spec_verify.py) applies penalties, logit_bias, min_tokens' ban and
    the grammar mask per position, then temperature, top-k, top-p and min-p, and returns each
    position's logprobs (a decoding row's prompt logprobs were sent with its first token): a row
    whose draw is seeded (its tokens would differ from the non-speculative ones) decodes without
    drafts."""
    p = req.sampling_params
    return p.is_greedy or p.seed is None


def _wants_prompt_logprobs(req: SchedReq) -> bool:
    # a resumed request sent its prompt logprobs before it was retracted
    return req.sampling_params.prompt_logprobs is not None and req.num_retractions == 0


def _prompt_logprob_plan(reqs: List[SchedReq]) -> PromptLogprobs | None:
    """Prefill: the flattened token rows whose logits give prompt logprobs (position p
    predicts prompt token p + 1), and those target tokens."""
    if not any(_wants_prompt_logprobs(r) for r in reqs):
        return None
    rows: List[int] = []
    targets: List[int] = []
    counts: List[int] = []  # per request of the batch: prompt logprobs this step produces
    offset = 0
    for req in reqs:
        count = 0
        if _wants_prompt_logprobs(req):
            last = min(req.device_len, req.prompt_len - 1)  # the last prompt token predicts nothing here
            for p in range(req.cached_len, last):
                rows.append(offset + p - req.cached_len)
                targets.append(req.token_ids[p + 1])
            count = max(0, last - req.cached_len)
        counts.append(count)
        offset += req.device_len - req.cached_len
    return PromptLogprobs(rows, targets, counts)
