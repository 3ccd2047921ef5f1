"""The tokenizer/detokenizer worker process.

From the API server it receives TokenizeMsg (encode the prompt, apply the chat template, start a
DetokState, forward a UserMsg to the scheduler; large prompts are encoded in an `EncodePool` so
that this loop keeps streaming everyone else's tokens meanwhile), TokenizeOnlyMsg (/tokenize and
/detokenize; large texts go to the pool too) and AbortReq (forget the request, forward an AbortMsg). From the scheduler it receives TokenBatchMsg (detokenize incrementally, match stop
strings, reply to the API server), ErrorMsg and SchedulerStats (relayed). A stop string ends the request
here, and the scheduler is told to abort it so its pages are freed at once.
"""

from __future__ import annotations

import signal
import traceback
from concurrent.futures import Future
from typing import Any, Dict, List, Tuple

import zmq

from minisgl.message import (
    AbortMsg,
    AbortReq,
    ErrorMsg,
    FlushCacheDone,
    FlushCacheMsg,
    ReplyBatchMsg,
    ReplyMsg,
    SchedulerStats,
    TokenBatchMsg,
    TokenizeMsg,
    TokenizeOnlyMsg,
    TokenOutput,
    ToolReply,
    UserMsg,
    decode_msg,
    encode_msg,
)
from minisgl.tokenizer.detokenize import DetokState, raw_decoder
from minisgl.tokenizer.encode_pool import EncodePool
from minisgl.tokenizer.tokenize import NO_TOKENIZER, PromptEncoder
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

IDLE_POLL_MS = 1000
ENCODING_POLL_MS = 5  # while prompts are being encoded in the pool


class TokenizerWorker:
    def __init__(self, tokenizer: Any, to_scheduler: zmq.Socket, to_api: zmq.Socket, pool: EncodePool | None = None) -> None:
        self.tokenizer = tokenizer
        self.raw_decoder = raw_decoder(tokenizer)  # the fast path of detokenization, when exact
        self.encoder = PromptEncoder(tokenizer)
        self.pool = pool
        self.encoding: Dict[int, Tuple[TokenizeMsg, "Future[List[int]]"]] = {}  # uid -> in the pool
        self.tokenizing: Dict[int, Tuple[TokenizeOnlyMsg, "Future[List[int]]"]] = {}  # /tokenize, in the pool
        self.to_scheduler = to_scheduler
        self.to_api = to_api
        self.states: Dict[int, DetokState] = {}
        self._piece_cache: Dict[int, str] = {}
        self._replies: List[ReplyMsg] = []

    # ---- outgoing ----------------------------------------------------------------------------
    def _to_scheduler(self, msg: Any) -> None:
        self.to_scheduler.send(encode_msg(msg), copy=False)

    def _to_api(self, msg: Any) -> None:
        self.to_api.send(encode_msg(msg), copy=False)

    def flush_replies(self) -> None:
        if self._replies:
            self._to_api(ReplyBatchMsg(merge_replies(self._replies)))
            self._replies = []

    # ---- incoming ----------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        if isinstance(msg, TokenBatchMsg):
            for out in msg.outputs:
                try:
                    self._on_token(out)
                except Exception:  # end this request only; the batch's others go on
                    logger.error("output of request %d failed:\n%s", out.uid, traceback.format_exc())
                    self._fail(out.uid)
        elif isinstance(msg, TokenizeMsg):
            self._on_tokenize(msg)
        elif isinstance(msg, AbortReq):
            pending = self.encoding.pop(msg.uid, None)
            if pending is not None:
                pending[1].cancel()  # never reached the scheduler
            elif self.states.pop(msg.uid, None) is not None:
                self._to_scheduler(AbortMsg(msg.uid))
        elif isinstance(msg, ErrorMsg):
            self.states.pop(msg.uid, None)
            self.flush_replies()  # keep the order of this request's messages
            self._to_api(msg)
        elif isinstance(msg, (SchedulerStats, FlushCacheDone)):
            self.flush_replies()  # they describe the state after the tokens already received
            self._to_api(msg)
        elif isinstance(msg, FlushCacheMsg):
            self._to_scheduler(msg)
        elif isinstance(msg, TokenizeOnlyMsg):
            self._on_tokenize_only(msg)
        else:
            logger.warning("tokenizer worker ignores a message of type %s", type(msg).__name__)

    def _on_tokenize(self, msg: TokenizeMsg) -> None:
        if self.pool is not None and msg.input_ids is None and self.pool.wants(msg.text, msg.messages):
            self.encoding[msg.uid] = (msg, self.pool.submit(msg.text, msg.messages, msg.chat_template_kwargs, msg.tools))
            return
        try:
            if msg.messages is not None:
                ids = self.encoder.encode_chat(msg.messages, msg.chat_template_kwargs, msg.tools)
            elif msg.input_ids is not None:
                ids = self.encoder.encode_ids(msg.input_ids)
            elif msg.text is not None:
                ids = self.encoder.encode_text(msg.text)
            else:
                raise ValueError("the request has no prompt")
        except Exception as exc:
            self._encode_failed(msg, exc)
            return
        self._start(msg, ids)

    def _on_tokenize_only(self, msg: TokenizeOnlyMsg) -> None:
        """/tokenize and /detokenize (the API server caps their size, as for generation)."""
        if self.tokenizer is None:  # the API server refuses these first; a second line of defence
            self._to_api(ErrorMsg(msg.uid, NO_TOKENIZER, 400, None, "tokenizer_required"))
            return
        if msg.token_ids is None and self.pool is not None and self.pool.wants(msg.text, msg.messages):
            # as for prompts: megabytes of text would stall everyone's streams for seconds here
            future = self.pool.submit_tokenize_only(msg.text, msg.messages, msg.add_special_tokens, msg.add_generation_prompt)
            self.tokenizing[msg.uid] = (msg, future)
            return
        try:
            if msg.token_ids is not None:
                self._to_api(ToolReply(msg.uid, text=self.tokenizer.decode(msg.token_ids, skip_special_tokens=False)))
                return
            ids = self.encoder.tokenize_only(msg.text, msg.messages, msg.add_special_tokens, msg.add_generation_prompt)
        except Exception as exc:
            self._tokenize_failed(msg, exc)
            return
        self._to_api(ToolReply(msg.uid, token_ids=ids))

    def _tokenize_failed(self, msg: TokenizeOnlyMsg, exc: BaseException) -> None:
        self._to_api(ErrorMsg(msg.uid, f"cannot tokenize: {exc}", 400, "messages" if msg.messages is not None else "prompt"))

    def _encode_failed(self, msg: TokenizeMsg, exc: BaseException) -> None:
        param = "messages" if msg.messages is not None else "prompt"
        if isinstance(exc, ValueError):
            self._to_api(ErrorMsg(msg.uid, str(exc), 400, param))
        else:
            logger.error("tokenization failed: %r", exc)  # the prompt is the only input: a 400
            self._to_api(ErrorMsg(msg.uid, f"tokenization failed: {type(exc).__name__}: {exc}", 400, param))

    def _start(self, msg: TokenizeMsg, ids: List[int]) -> None:
        self.states[msg.uid] = DetokState(
            self.tokenizer,
            msg.sampling.stop,
            msg.want_logprobs,
            msg.skip_special_tokens,
            len(ids),
            msg.sampling.include_stop_str_in_output,
            self.raw_decoder,
        )
        if msg.sampling.prompt_logprobs is not None:
            self.states[msg.uid].prompt_ids = ids[:1]
        self._to_scheduler(UserMsg(msg.uid, ids, msg.sampling, msg.max_tokens_explicit, msg.group))

    def collect_encoded(self) -> None:
        """Start the requests whose prompts the pool has finished encoding, and answer the
        /tokenize calls it has finished."""
        for uid, (msg, future) in list(self.encoding.items()):
            if not future.done():
                continue
            del self.encoding[uid]
            exc = future.exception()
            if exc is not None:
                self._encode_failed(msg, exc)
            else:
                self._start(msg, future.result())
        for uid, (call, done) in list(self.tokenizing.items()):
            if not done.done():
                continue
            del self.tokenizing[uid]
            exc = done.exception()
            if exc is not None:
                self._tokenize_failed(call, exc)
            else:
                self._to_api(ToolReply(uid, token_ids=done.result()))

    @property
    def in_pool(self) -> bool:
        return bool(self.encoding or self.tokenizing)

    def _piece(self, token_id: int) -> str:
        piece = self._piece_cache.get(token_id)
        if piece is None and self.tokenizer is None:
            return ""
        if piece is None:
            piece = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._piece_cache) < 200_000:
                self._piece_cache[token_id] = piece
        return piece

    def _on_token(self, out: TokenOutput) -> None:
        state = self.states.get(out.uid)
        if state is None:
            return  # aborted, or ended by a stop string: the scheduler's late outputs are dropped
        new_ids = [out.token_id] if out.token_id is not None else []
        state.completion_tokens += len(new_ids)
        try:
            delta = state.detok.add(new_ids, final=out.finished)
        except Exception as exc:  # a token id the tokenizer cannot decode
            logger.error("detokenization failed for request %d: %s", out.uid, exc)
            delta = ""
        text, matched = state.stop.feed(delta, final=out.finished)
        logprobs = None
        if state.want_logprobs and out.token_id is not None and out.logprob is not None:
            tops = [[self._piece(int(t)), _finite(lp)] for t, lp in (out.top_logprobs or [])]
            logprobs = [[self._piece(out.token_id), _finite(out.logprob), tops, out.token_id]]
        prompt_lp: List[List[Any]] | None = None
        if out.prompt_logprobs is not None:
            first = state.prompt_ids[0] if state.prompt_ids else None
            prompt_lp = [[self._piece(first), None, [], first]] if first is not None else []
            for token, lp, tops in out.prompt_logprobs:
                alts = [[self._piece(int(t)), _finite(v)] for t, v in tops]
                prompt_lp.append([self._piece(int(token)), _finite(lp), alts, int(token)])
        reply = ReplyMsg(
            prompt_logprobs=prompt_lp,
            uid=out.uid,
            text=text,
            num_tokens=len(new_ids),
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens or state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            cached_tokens=out.cached_tokens,
            logprobs=logprobs,
            token_ids=new_ids,
            embedding=out.embedding,
        )
        if matched is not None and not out.finished:
            reply.finished, reply.finish_reason, reply.matched_stop = True, "stop", matched
            self._to_scheduler(AbortMsg(out.uid))  # free its pages now
        elif matched is not None:
            reply.finish_reason, reply.matched_stop = "stop", matched
        elif out.finished and out.finish_reason == "stop" and out.token_id is not None:
            reply.matched_stop = out.token_id
        if reply.finished:
            del self.states[out.uid]
        self._replies.append(reply)

    def _fail(self, uid: int) -> None:
        """End a request this worker failed on: a 500 for its client, and an abort for the
        scheduler, which may already be running it (it would otherwise generate for nobody)."""
        self.encoding.pop(uid, None)
        if self.states.pop(uid, None) is not None:
            self._to_scheduler(AbortMsg(uid))
        self._to_api(ErrorMsg(uid, "internal error in the tokenizer worker", 500))

    # ---- loop --------------------------------------------------------------------------------
    def run(self, recv_sock: zmq.Socket, parent_pid: int | None = None) -> None:
        from minisgl.server.process_utils import parent_alive

        while True:
            if not recv_sock.poll(ENCODING_POLL_MS if self.in_pool else IDLE_POLL_MS):
                self.collect_encoded()
                if not self.in_pool and parent_pid is not None and not parent_alive(parent_pid):
                    logger.error("the server process is gone; tokenizer worker exits")
                    return
                continue
            while True:
                try:
                    data = recv_sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode_msg(data)
                except Exception as exc:
                    logger.error("tokenizer worker dropped an undecodable message: %s", exc)
                    continue
                try:
                    self.handle(msg)
                except Exception:  # keep serving everyone else
                    logger.error("tokenizer worker failed on %s:\n%s", type(msg).__name__, traceback.format_exc())
                    uid = getattr(msg, "uid", None)
                    if uid is not None:
                        self._fail(uid)
            self.collect_encoded()
            self.flush_replies()


def merge_replies(replies: List[ReplyMsg]) -> List[ReplyMsg]:
    """One reply per request: when this loop drained several scheduler steps at once (it, or the
    API server, is behind), a request's replies become one, so the API server wakes its stream
    and writes its socket once instead of once per token. Order within a request is kept."""
    if len(replies) < 2:
        return replies
    first: Dict[int, ReplyMsg] = {}
    out: List[ReplyMsg] = []
    for r in replies:
        a = first.get(r.uid)
        if a is None:
            first[r.uid] = r
            out.append(r)
            continue
        a.text += r.text
        a.num_tokens += r.num_tokens
        a.token_ids = (a.token_ids or []) + (r.token_ids or [])
        if r.logprobs:
            a.logprobs = (a.logprobs or []) + r.logprobs
        a.prompt_logprobs = a.prompt_logprobs if a.prompt_logprobs is not None else r.prompt_logprobs
        a.embedding = a.embedding if a.embedding is not None else r.embedding
        a.finished, a.finish_reason, a.matched_stop = r.finished, r.finish_reason, r.matched_stop
        a.prompt_tokens, a.completion_tokens, a.cached_tokens = r.prompt_tokens, r.completion_tokens, r.cached_tokens
    return out


def _finite(logprob: float) -> float:
    """JSON has no -inf/NaN: clamp like vLLM does."""
    value = float(logprob)
    return value if value > -9999.0 else -9999.0  # also maps NaN (all comparisons false)


def describe_tokenizer(tokenizer: Any, chat_template: str | None) -> Dict[str, Any] | None:
    """What GET /tokenizer_info returns (after vLLM's): enough for a client such as lm-eval to
    tokenize and render chats as the server does without a local copy of the tokenizer folder."""
    if tokenizer is None:
        return None

    def text(token: Any) -> str | None:
        return None if token is None else str(token)

    limit = getattr(tokenizer, "model_max_length", None)
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "is_fast": bool(getattr(tokenizer, "is_fast", False)),
        "vocab_size": len(tokenizer),  # with the added tokens
        "model_max_length": limit if isinstance(limit, int) and limit < 1 << 53 else None,  # HF's "no limit" is 1e30
        "bos_token": text(tokenizer.bos_token),
        "eos_token": text(tokenizer.eos_token),
        "pad_token": text(tokenizer.pad_token),
        "unk_token": text(tokenizer.unk_token),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "additional_special_tokens": [str(t) for t in getattr(tokenizer, "additional_special_tokens", [])],
        "added_tokens": {str(i): str(t) for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())},
        "padding_side": getattr(tokenizer, "padding_side", None),
        "truncation_side": getattr(tokenizer, "truncation_side", None),
        "clean_up_tokenization_spaces": bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)),
        "chat_template": chat_template,
    }


def run_tokenizer_worker(args: Any, ready_conn: Any) -> None:
    """Entry point of the tokenizer worker process (multiprocessing spawn target)."""
    from minisgl.server.process_utils import IpcAddrs, fail_startup, push_socket, setup_child_process

    parent = setup_child_process("minisgl-tokenizer", args.log_level)
    tokenizer: Any = None  # --skip-tokenizer-init: token ids in, token ids out
    try:
        if args.tokenizer_path is not None:
            from minisgl.utils.hf import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer_path)
    except BaseException as exc:
        fail_startup(ready_conn, "tokenizer worker", exc)
    addrs = IpcAddrs.in_dir(args.ipc_dir)
    ctx = zmq.Context()
    recv_sock = ctx.socket(zmq.PULL)
    recv_sock.bind(addrs.tokenizer)
    to_scheduler = push_socket(ctx, addrs.scheduler)
    to_api = push_socket(ctx, addrs.api)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default") or next(iter(template.values()), None)
    ready_conn.send((
        "ready",
        {"has_chat_template": template is not None, "chat_template": template, "tokenizer": args.tokenizer_path,
         "info": describe_tokenizer(tokenizer, template)},
    ))  # fmt: skip
    ready_conn.close()
    logger.info("tokenizer worker ready (%s)", args.tokenizer_path or "no tokenizer: --skip-tokenizer-init")
    use_pool = tokenizer is not None and args.num_tokenizer_workers > 0
    pool = EncodePool(args.tokenizer_path, args.num_tokenizer_workers, args.log_level) if use_pool else None
    if pool is not None:
        # The pool's queues hold named semaphores that only a normal exit unlinks: leaving by
        # os._exit (the children's SIGTERM handler) left them to the resource tracker, which
        # warned of 5 leaked semaphores at every stop. SystemExit runs the `finally` below.
        signal.signal(signal.SIGTERM, _exit_normally)
    try:
        TokenizerWorker(tokenizer, to_scheduler, to_api, pool).run(recv_sock, parent)
    finally:
        if pool is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the shutdown itself is not interrupted
            pool.shutdown()
        for sock in (recv_sock, to_scheduler, to_api):
            sock.close(linger=0)
        ctx.term()


def _exit_normally(signum: int, frame: Any) -> None:
    raise SystemExit(0)
