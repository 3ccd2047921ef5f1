"""LLM: run the scheduler in this process and generate for a list of prompts.

Prompts may be text, token-id lists, or chat conversations (lists of {"role", "content"}
messages, rendered with the tokenizer's chat template). Every prompt is validated before any is
queued, so a bad one raises ValueError and leaves the LLM usable.
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple, Union

import numpy as np
import torch

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo, host_rendezvous
from minisgl.engine.engine import check_tp_size
from minisgl.scheduler import Scheduler, SchedulerConfig, UserRequest
from minisgl.scheduler.tp import LeaderScheduler, WorkerRanks
from minisgl.tokenizer.detokenize import IncrementalDetokenizer, StopMatcher, raw_decoder
from minisgl.utils.hf import cached_load_hf_config, load_tokenizer, resolve_model_path
from minisgl.utils.torch_utils import auto_dtype, parse_dtype

OFFLINE_MAX_EXTEND_TOKENS = 16384
# On a CPU the prefill is compute-bound and its activations are what a chunk keeps in cache:
# benchmark/cpu.py's offline recipe ran fastest at 4096-token chunks, of 3072 to 16384
# (docs/PERFORMANCE.md).
CPU_OFFLINE_MAX_EXTEND_TOKENS = 4096
Message = Dict[str, Any]
Prompt = Union[str, List[int], List[Message]]


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: List[float] | None = None
    top_logprobs: List[List[Tuple[int, float]]] | None = field(default=None, repr=False)
    # with SamplingParams(prompt_logprobs=k): [token id, logprob, [(id, logprob), ...]] for every
    # prompt token but the first
    prompt_logprobs: List[List[Any]] | None = field(default=None, repr=False)
    # what ended it with finish_reason "stop": the stop string or stop token id (None: EOS or not stopped)
    stop_reason: str | int | None = None


class LLM:
    def __init__(
        self,
        model_path: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        tp: int = 1,
        **config: Any,
    ) -> None:
        path = resolve_model_path(model_path)
        target = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
        resolved = auto_dtype(cached_load_hf_config(path), target) if dtype == "auto" else parse_dtype(dtype)
        self.model_path = path
        # A config-only or weights-only folder (dummy weights, tiny test models) has no tokenizer:
        # such an LLM takes token-id prompts only and returns empty text. Loaded before the
        # engine so a failure here cannot leave an engine (and its global Context) behind.
        self.tokenizer = _load_tokenizer_if_any(path)
        # Offline, nobody waits on inter-token latency, so on CUDA prefill takes bigger steps than the
        # server's 8192: each prefill step is an eager forward whose launch cost the GPU mostly
        # idles through, so fewer steps win throughput.
        config.setdefault("max_extend_tokens", OFFLINE_MAX_EXTEND_TOKENS if target.type == "cuda" else CPU_OFFLINE_MAX_EXTEND_TOKENS)
        # nor on the length of a step: no prompt-token cap beside decoding rows (the server's CPU default)
        config.setdefault("max_step_ms", 0.0)
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a positive integer, got {tp!r}")
        # Ranks on this machine meet at a store this process serves, on a port bound before they
        # start: never another LLM's, and no other process can take it in between.
        self._rendezvous: Any = None
        if tp > 1 and "distributed_port" not in config and "dist_init_addr" not in config:
            self._rendezvous, config["dist_init_addr"] = host_rendezvous()
            config["dist_store_hosted"] = True
        sched_config = SchedulerConfig(model_path=path, tp_info=DistributedInfo(0, tp), dtype=resolved, device=device, **config)
        self._workers: WorkerRanks | None = None
        if tp == 1:
            self.scheduler: Scheduler = Scheduler(sched_config)
        else:
            self.scheduler = self._start_tp(sched_config)
        self._closed = False
        self._uids = itertools.count()

    def _start_tp(self, config: SchedulerConfig) -> Scheduler:
        """Spawn ranks 1..tp-1 (each follows rank 0's schedule), then build rank 0 here."""
        check_tp_size(config.model_config, config.tp_info.size)  # before any process starts
        workers = WorkerRanks(config)
        # Rank 0 lives in this process; the followers must not outlive it, even when the caller
        # never calls shutdown() (weakref.finalize also runs at interpreter exit).
        self._finalizer = weakref.finalize(self, workers.kill)
        try:
            workers.wait_started()
        except BaseException:
            workers.kill()
            raise
        try:
            scheduler = LeaderScheduler(config)
        except BaseException as exc:
            details = workers.startup_errors()
            workers.kill()
            if details:
                raise RuntimeError(f"tensor-parallel start-up failed: {exc}; {details}") from exc
            raise
        try:
            workers.wait_ready(timeout=config.distributed_timeout)
        except BaseException:
            workers.kill()
            scheduler.shutdown()
            raise
        self._workers = workers
        return scheduler

    # ---- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt, index: int = 0) -> List[int]:
        if self.tokenizer is None and isinstance(prompt, (str, list, tuple)) and not _is_token_list(prompt):
            raise ValueError(f"prompt {index}: the model folder {self.model_path!r} has no tokenizer; pass token ids instead")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenizer.apply_chat_template(list(prompt), tokenize=True, add_generation_prompt=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if _is_token_list(prompt):
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            return [int(t) for t in prompt]  # type: ignore[arg-type]  # checked by _is_token_list
        raise ValueError(f"prompt {index} must be a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}")

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> List[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, dict)):
            return [list(prompts)]  # one token list or one conversation
        return list(prompts)  # type: ignore[arg-type]

    # ---- embeddings --------------------------------------------------------------------------
    def embed(self, prompts: Prompt | Sequence[Prompt]) -> List[List[float]]:
        """One pooled vector per prompt (text or token ids), on an LLM that runs the embed task
        (`LLM(path, task="embed")`, or an embedding checkpoint): the same path as the server's
        /v1/embeddings (engine/pooling.py)."""
        if self.scheduler.pooling is None:
            raise ValueError("this LLM runs the generate task: build it with LLM(path, task='embed') to embed")
        items = self._as_list(prompts)
        if not items:
            raise ValueError("prompts is empty")
        requests = [UserRequest(next(self._uids), self.encode(p, i), SamplingParams(max_tokens=1)) for i, p in enumerate(items)]
        for req in requests:  # validate all before queueing any
            self.scheduler.validate(req)
        for req in requests:
            self.scheduler.add_request(req)
        vectors: Dict[int, List[float]] = {}
        with _interrupts_between_steps(self._workers is not None) as check_interrupt:
            try:
                while len(vectors) < len(requests):
                    for out in self.scheduler.step():
                        if out.embedding is not None:
                            vectors[out.uid] = np.frombuffer(out.embedding, dtype="<f4").tolist()
                    check_interrupt()
                self.scheduler.run_until_idle()
            except BaseException:
                for req in requests:
                    if req.uid not in vectors:
                        self.scheduler.abort(req.uid)
                self.scheduler.run_until_idle()
                raise
        return [vectors[req.uid] for req in requests]

    # ---- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> List[GenerationResult]:
        if self.scheduler.pooling is not None:
            raise ValueError("this LLM runs the embed task: call embed(), or build LLM(path, task='generate') from a causal LM")
        items = self._as_list(prompts)
        if not items:
            raise ValueError("prompts is empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"got {len(params)} sampling_params for {len(items)} prompts")
        requests = [UserRequest(next(self._uids), self.encode(p, i), sp) for i, (p, sp) in enumerate(zip(items, params))]
        pending = set()
        for req in requests:  # validate all before queueing any: a bad prompt leaves nothing behind
            self.scheduler.validate(req)
            if req.sampling_params.stop and self.tokenizer is None:
                raise ValueError(
                    "SamplingParams.stop: stop strings are matched on text, and this model has no tokenizer (use stop_token_ids)"
                )
        # requests with stop strings are detokenized as they go, to end them at the first match
        texts = {r.uid: _TextStream(self.tokenizer, r.sampling_params) for r in requests if r.sampling_params.stop}
        for req in requests:
            self.scheduler.add_request(req)
            pending.add(req.uid)
        tokens: Dict[int, List[int]] = {r.uid: [] for r in requests}
        logps: Dict[int, List[float]] = {r.uid: [] for r in requests}
        tops: Dict[int, List[List[Tuple[int, float]]]] = {r.uid: [] for r in requests}
        finals: Dict[int, Any] = {}
        prompt_lps: Dict[int, List[List[Any]]] = {}
        bar = _progress(len(requests), use_tqdm)
        with _interrupts_between_steps(self._workers is not None) as check_interrupt:
            try:
                while pending:
                    for out in self.scheduler.step():
                        if out.uid not in pending:
                            continue
                        if out.prompt_logprobs is not None:
                            prompt_lps[out.uid] = out.prompt_logprobs
                        if out.token_id is not None:
                            tokens[out.uid].append(out.token_id)
                            if out.logprob is not None:
                                logps[out.uid].append(out.logprob)
                                tops[out.uid].append(out.top_logprobs or [])
                        stream = texts.get(out.uid)
                        if stream is not None and stream.feed(out.token_id, out.finished) is not None and not out.finished:
                            self.scheduler.abort(out.uid)  # a stop string: its pages are freed now
                            out.finished, out.finish_reason = True, "stop"
                        if out.finished:
                            finals[out.uid] = out
                            pending.discard(out.uid)
                            if bar is not None:
                                bar.update(1)
                    check_interrupt()  # Ctrl-C lands here, between steps, at tp > 1
                self.scheduler.run_until_idle()  # retire the step still in flight (overlap)
            except BaseException:
                for uid in pending:
                    self.scheduler.abort(uid)
                self.scheduler.run_until_idle()
                raise
            finally:
                if bar is not None:
                    bar.close()
        results = []
        for req in requests:
            fin = finals[req.uid]
            ids = tokens[req.uid]
            wants_lp = req.sampling_params.logprobs is not None
            stream = texts.get(req.uid)
            if stream is not None:
                text = stream.text
            else:
                text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
            stop_reason: str | int | None = stream.matched if stream is not None else None
            if stop_reason is None and fin.finish_reason == "stop" and ids and ids[-1] in req.sampling_params.stop_token_ids:
                stop_reason = ids[-1]
            results.append(
                GenerationResult(
                    text=text,
                    token_ids=ids,
                    finish_reason=fin.finish_reason,
                    prompt_tokens=len(req.input_ids),
                    completion_tokens=len(ids),
                    cached_tokens=fin.cached_tokens,
                    logprobs=logps[req.uid] if wants_lp else None,
                    top_logprobs=tops[req.uid] if wants_lp else None,
                    prompt_logprobs=prompt_lps.get(req.uid) if req.sampling_params.prompt_logprobs is not None else None,
                    stop_reason=stop_reason,
                )
            )
        return results

    def chat(
        self, messages: List[Message] | Sequence[List[Message]], sampling_params: SamplingParams | None = None
    ) -> List[GenerationResult]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item]
        return self.generate(convs, sampling_params)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Stop the scheduler (and, at tp > 1, every worker rank: none is left behind)."""
        if getattr(self, "_closed", True):
            return  # already shut down, or __init__ failed before the scheduler existed
        self._closed = True
        try:
            self.scheduler.shutdown()
        finally:
            if self._workers is not None:
                self._workers.shutdown()
                self._workers = None
                self._finalizer.detach()
            self._rendezvous = None  # the store goes once no rank is left to use it

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _TextStream:
    """One request's text as its tokens arrive, trimmed at its first stop string exactly as the
    server's tokenizer worker trims it (the same incremental detokenizer and matcher)."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, raw=raw_decoder(tokenizer))
        self.stop = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.matched: str | None = None

    def feed(self, token_id: int | None, final: bool) -> str | None:
        """Add one token; return the stop string it completed, if any (the text ends there)."""
        if self.matched is not None:
            return None
        delta = self.detok.add([token_id] if token_id is not None else [], final=final)
        released, self.matched = self.stop.feed(delta, final=final)
        self.text += released
        return self.matched


@contextmanager
def _interrupts_between_steps(enabled: bool) -> Iterator[Callable[[], None]]:
    """At tp > 1, a Ctrl-C (SIGINT) is held until the current step is over and raised between
    steps: a step abandoned half-way would leave the worker ranks inside a collective, waiting for
    rank 0 forever. Only the main thread receives signals, so elsewhere this does nothing."""
    hit: List[int] = []

    def check() -> None:
        if hit:
            hit.clear()
            raise KeyboardInterrupt

    if not enabled or threading.current_thread() is not threading.main_thread():
        yield check
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or previous is None:
        yield check
        return
    signal.signal(signal.SIGINT, lambda signum, frame: hit.append(signum))
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


def _is_token_list(prompt: Any) -> bool:
    """A list of Python ints (not bools, not floats); checked in C, prompts can be long."""
    if not isinstance(prompt, (list, tuple)):
        return False
    if not prompt:
        return True
    try:
        return np.asarray(prompt).dtype.kind in "iu"
    except (ValueError, TypeError):  # ragged or mixed content
        return False


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer_if_any(path: str) -> Any:
    if not any((Path(path) / name).exists() for name in _TOKENIZER_FILES):
        return None
    return load_tokenizer(path)


def _progress(total: int, use_tqdm: bool | None) -> Any:
    if use_tqdm is None:
        use_tqdm = total >= 8 and sys.stderr.isatty()
    if not use_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
