"""Tensor parallelism on CPU (gloo, float32): `LLM(tp=2)` against `LLM(tp=1)` on tiny random
models of each sharding case — Qwen3 (q/k norm, tied vocab-parallel head), Llama with one KV
head (replicated over both ranks), Qwen2 (q/k/v biases, an odd vocabulary: a padded shard) and
Qwen3-MoE (tensor-parallel experts) —
through continuous batching, chunked prefill, page_size 4 and the radix cache (a warm rerun).
Greedy tokens must be identical and logprobs within 1e-4; every rank's token pool and scheduling
state must agree (LeaderScheduler.rank_fingerprints); shutdown, a dead rank, Ctrl-C and
interpreter exit leave no process behind (or stranded).

On CUDA this needs two GPUs (NCCL refuses two ranks on one device); it is skipped otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from helpers import TEST_DEVICE, build_tiny_model
from sched_helpers import assert_idle_and_clean, llm_kwargs

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo, DistributedInitError
from minisgl.llm import LLM
from minisgl.sampling_params import GrammarSpec
from minisgl.scheduler import UserRequest

if TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 2:
    pytest.skip("tp=2 on CUDA needs two GPUs (NCCL cannot put two ranks on one device)", allow_module_level=True)

LOGPROB_ATOL = 1e-4
# name -> (TINY_ARCHS key, config overrides); 4 query heads and 2 KV heads unless overridden
TP_ARCHS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    "llama_kv1": ("llama", dict(num_key_value_heads=1)),  # fewer KV heads than ranks: replicated
    "qwen2": ("qwen2", dict(vocab_size=301)),  # q/k/v biases; 301 = 2 x 151 - 1: rank 1's last row is padding
    "qwen3_moe": ("qwen3_moe", {}),
}


def _kwargs(**kw: Any) -> Dict[str, Any]:
    # 4 rows for 12 prompts (requests queue and join running decodes), 16-token prefill steps
    # (prompts of up to 40 tokens are chunked), 4-token pages, the radix cache.
    kw.setdefault("max_running_req", 4)
    kw.setdefault("max_extend_tokens", 16)
    kw.setdefault("page_size", 4)
    kw.setdefault("cache_type", "radix")
    kw.setdefault("max_seq_len_override", 96)
    kw.setdefault("num_page_override", 4 * 96 // 4 + 8)
    return llm_kwargs(**kw)


def _workload() -> Tuple[List[List[int]], List[SamplingParams]]:
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(1, 256, (24,), generator=gen).tolist()  # a prefix the radix cache can reuse
    prompts = []
    for i in range(12):
        tail = torch.randint(1, 256, (1 + 3 * i,), generator=gen).tolist()
        prompts.append(shared + tail if i % 2 else tail)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (5 * i) % 13, logprobs=3) for i in range(12)]
    return prompts, params


def _run(llm: LLM) -> List[Any]:
    prompts, params = _workload()
    cold = llm.generate(prompts, params)
    warm = llm.generate(prompts, params)  # the shared prefixes and whole prompts are cached now
    return cold + warm


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory):
    cache: Dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            arch, extra = TP_ARCHS[name]
            cache[name] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tp_{name}"), seed=20 + len(cache), **extra)
        return cache[name]

    return get


@pytest.fixture(scope="module", params=sorted(TP_ARCHS))
def tp_pair(request, tp_model_dir):
    """(name, tp=1 results, tp=2 results) of the workload, cold then warm."""
    path = str(tp_model_dir(request.param))
    with LLM(path, **_kwargs()) as llm:
        ref = _run(llm)
        assert_idle_and_clean(llm.scheduler)
        shapes1 = _shapes(llm)
    llm2 = LLM(path, tp=2, **_kwargs())
    try:
        _check_sharded(request.param, shapes1, _shapes(llm2))
        out = _run(llm2)
        fps = llm2.scheduler.rank_fingerprints()
        assert_idle_and_clean(llm2.scheduler)
        fps_after_reset = llm2.scheduler.rank_fingerprints()  # the reset reached the follower too
    finally:
        llm2.shutdown()
    return request.param, ref, out, fps, fps_after_reset


def _shapes(llm: LLM) -> Dict[str, Tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in llm.scheduler.engine.model.named_parameters()}


def _check_sharded(name: str, full: Dict[str, Tuple[int, ...]], local: Dict[str, Tuple[int, ...]]) -> None:
    """Rank 0 holds half of every sharded matrix (a KV head of its own or, with one KV head, a replica)."""
    attn = "model.layers.0.self_attn."
    q, kv = full[attn + "qkv_proj.weight"][0], local[attn + "qkv_proj.weight"][0]
    assert local["model.embed_tokens.weight"][0] == -(-full["model.embed_tokens.weight"][0] // 2), name
    assert local[attn + "o_proj.weight"][1] * 2 == full[attn + "o_proj.weight"][1], name
    if name == "llama_kv1":  # 4 q heads + 1 k + 1 v -> 2 q heads + the replicated k and v
        assert kv == q // 6 * 4, (name, q, kv)
    else:
        assert kv * 2 == q, (name, q, kv)
    if name == "qwen3_moe":
        experts = "model.layers.0.mlp.experts."
        assert local[experts + "w13"][1] * 2 == full[experts + "w13"][1]
        assert local[experts + "w2"][2] * 2 == full[experts + "w2"][2]
    else:
        mlp = "model.layers.0.mlp."
        assert local[mlp + "down_proj.weight"][1] * 2 == full[mlp + "down_proj.weight"][1], name


def test_tp2_equals_tp1(tp_pair):
    name, ref, out, _, _ = tp_pair
    assert len(ref) == len(out) == 24
    for i, (a, b) in enumerate(zip(ref, out)):
        label = f"{name} request {i % 12} ({'warm' if i >= 12 else 'cold'})"
        assert b.token_ids == a.token_ids, f"{label}: tp=2 {b.token_ids} != tp=1 {a.token_ids}"
        assert b.finish_reason == a.finish_reason == "length", label
        assert b.cached_tokens == a.cached_tokens, label
        lp_a, lp_b = torch.tensor(a.logprobs), torch.tensor(b.logprobs)
        assert (lp_a - lp_b).abs().max() < LOGPROB_ATOL, f"{label}: logprobs differ by {(lp_a - lp_b).abs().max():.3g}"
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in ta] == [t for t, _ in tb], label
            assert max(abs(x - y) for (_, x), (_, y) in zip(ta, tb)) < LOGPROB_ATOL, label
    # the warm rerun really hit the cache, and the chunked prompts really were chunked
    assert sum(r.cached_tokens for r in out[12:]) > sum(r.cached_tokens for r in out[:12]) > 0
    assert max(r.prompt_tokens for r in out) > _kwargs()["max_extend_tokens"]


def test_tp2_ranks_agree(tp_pair):
    name, _, _, fps, fps_after_reset = tp_pair
    assert len(fps) == 2 and fps[0] == fps[1], f"{name}: the ranks' scheduling state diverged"
    assert fps_after_reset[0] == fps_after_reset[1]


# ---------------------------------------------------------------------------------------------
# One shared tp=2 LLM for sampling, aborts and bad input
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_dir(tp_model_dir):
    return str(tp_model_dir("qwen3"))


_SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=100 + i) for i in range(6)]
_SHARED_KW = dict(max_running_req=8, page_size=1, num_page_override=8 * 96 + 8)


@pytest.fixture(scope="module")
def seeded_ref(qwen3_dir):
    """Seeded sampling at tp=1 (built before the tp=2 LLM: one engine per process at a time)."""
    with LLM(qwen3_dir, **_kwargs(**_SHARED_KW)) as llm1:
        return [r.token_ids for r in llm1.generate(_workload()[0][:6], _SEEDED)]


@pytest.fixture(scope="module")
def llm2(qwen3_dir, seeded_ref):
    llm = LLM(qwen3_dir, tp=2, **_kwargs(**_SHARED_KW))
    yield llm
    llm.shutdown()


def test_sampling_same_token_on_every_rank(llm2, seeded_ref):
    prompts, _ = _workload()
    seeded = _SEEDED
    unseeded = [SamplingParams(temperature=1.0, max_tokens=12) for _ in range(6)]
    mixed = seeded[:3] + unseeded[:3] + [SamplingParams(temperature=0.0, max_tokens=12)] * 2
    out = llm2.generate(prompts[:8], mixed)
    assert all(len(r.token_ids) == 12 for r in out)
    fps = llm2.scheduler.rank_fingerprints()
    assert fps[0] == fps[1], "a random draw differed between the ranks"
    # a seeded request draws from its seed and position only: the same tokens as at tp=1
    again = llm2.generate(prompts[:6], seeded)
    assert [r.token_ids for r in again] == seeded_ref
    assert_idle_and_clean(llm2.scheduler)


def test_abort_and_bad_input_keep_ranks_in_step(llm2):
    sched = llm2.scheduler
    prompts, _ = _workload()
    for uid, p in enumerate(prompts[:6], start=10_000):
        sched.add_request(UserRequest(uid, p, SamplingParams(temperature=0.0, max_tokens=30)))
    for _ in range(4):
        sched.step()
    assert sched.abort(10_001) and sched.abort(10_005)  # one running, one maybe still waiting
    assert not sched.abort(99_999)
    sched.run_until_idle()
    with pytest.raises(ValueError, match="input_ids"):
        llm2.generate([[1, 2, 999]])  # rejected on rank 0 before any rank sees it
    assert llm2.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))[0].completion_tokens == 3
    fps = sched.rank_fingerprints()
    assert fps[0] == fps[1]
    assert_idle_and_clean(sched)


def test_speculative_verify_steps_keep_ranks_in_step(llm2):
    """N-gram speculation at tp=2 (rank 0's policy drafts; every rank runs the verify step of
    the plan): greedy outputs, plain and with penalties, logit_bias, min_tokens or a grammar, equal
    speculation off, drafts are accepted, unseeded sampled rows speculate beside them, and the
    ranks' token pools and page tables stay identical."""
    from test_spec_ngram import _copy_heavy_prompts

    sched = llm2.scheduler
    prompts = _copy_heavy_prompts(6, seed=2)
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in prompts[:3]]
    greedy += [  # verified with the penalties (followers count from the plans' history), bias and min_tokens ban
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={7: 2.0}),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, stop_token_ids=[9, 11]),
        SamplingParams(temperature=0.0, max_tokens=12, grammar=GrammarSpec("json_object")),
    ]
    prompts.append(prompts[0])
    off = llm2.generate(prompts, greedy)
    before = sched.stats()
    sched.speculative = "ngram"
    try:
        on = llm2.generate(prompts, greedy)
        sampled = llm2.generate(prompts[:4], [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)] * 4)
    finally:
        sched.speculative = None
    after = sched.stats()
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert all(len(r.token_ids) == 24 for r in sampled)
    assert after.spec_accepted_tokens > before.spec_accepted_tokens and after.spec_verify_rows > before.spec_verify_rows
    fps = sched.rank_fingerprints()
    assert fps[0] == fps[1], "the ranks' token pools or page tables differ after verify steps"
    assert_idle_and_clean(sched)


def test_shutdown_leaves_no_process(llm2):
    """The last test of the shared LLM: it shuts it down."""
    llm = llm2
    procs = list(llm._workers.procs)
    assert len(procs) == 1 and procs[0].is_alive()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    llm.shutdown()
    assert not procs[0].is_alive() and procs[0].exitcode == 0
    llm.shutdown()  # twice is harmless


def test_dead_rank_fails_fast(qwen3_dir):
    llm = LLM(qwen3_dir, tp=2, **_kwargs())
    try:
        proc = llm._workers.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
        assert time.monotonic() - start < 30
        assert not isinstance(info.value, AssertionError), info.value
    finally:
        llm.shutdown()


def test_interpreter_exit_without_shutdown_leaves_no_process(qwen3_dir):
    proc = _run_script("tp_exit_without_shutdown.py", qwen3_dir, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pid = int(next(line for line in proc.stdout.splitlines() if line.startswith("WORKER")).split()[1])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"worker rank pid {pid} outlived its interpreter"


def _run_script(name: str, model_dir: str, timeout: float) -> subprocess.CompletedProcess:
    """Run tests/scripts/<name> in a fresh interpreter (signals and interpreter exit need one)."""
    root = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    script = Path(__file__).parent / "scripts" / name
    return subprocess.run([sys.executable, str(script), model_dir], capture_output=True, text=True, timeout=timeout, env=env)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Rendezvous
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hosted", [False, True])
def test_rank_that_never_joins_times_out(qwen3_dir, hosted):
    """Rank 0 serving the store at a port found free, or this process serving it (as LLM(tp=N) and
    the server launcher do): either way a missing rank is a clear error within the timeout."""
    from minisgl.distributed import host_rendezvous
    from minisgl.engine import Engine, EngineConfig
    from minisgl.server.process_utils import free_port

    store, addr = host_rendezvous() if hosted else (None, f"127.0.0.1:{free_port()}")
    config = EngineConfig(
        model_path=qwen3_dir, tp_info=DistributedInfo(0, 2), dtype=torch.float32, device="cpu",
        distributed_timeout=2, dist_init_addr=addr, dist_store_hosted=hosted, num_page_override=16,
        max_seq_len_override=64, max_running_req=2,
    )  # fmt: skip
    start = time.monotonic()
    with pytest.raises(DistributedInitError, match=r"rank 0 of 2.*did not all join.*distributed_timeout=2"):
        Engine(config)
    assert time.monotonic() - start < 20
    del store
    import torch.distributed as dist

    import minisgl.core

    assert minisgl.core._GLOBAL_CTX is None and not dist.is_initialized()


def test_llm_tp_rendezvous_port_is_held_from_before_the_ranks_start(qwen3_dir, monkeypatch):
    """LLM(tp=2) serves its ranks' store itself on a port it bound first: another process cannot
    take it between the choice and rank 0's listen (the EADDRINUSE race of a port found free).
    A would-be thief tries the port just before the worker ranks are spawned, and again later."""
    import socket

    import minisgl.llm.llm as llm_module

    def try_to_take(config: Any) -> None:
        host, _, port = config.dist_init_addr.rpartition(":")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
            with pytest.raises(OSError, match="in use"):
                thief.bind((host, int(port)))

    real_workers = llm_module.WorkerRanks

    def spawn(config: Any) -> Any:
        try_to_take(config)
        return real_workers(config)

    monkeypatch.setattr(llm_module, "WorkerRanks", spawn)
    with LLM(qwen3_dir, tp=2, **_kwargs()) as llm:
        try_to_take(llm.scheduler.config)
        assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))[0].completion_tokens == 3


def test_bad_tp_value(qwen3_dir):
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        LLM(qwen3_dir, tp=0, **_kwargs())


# ---------------------------------------------------------------------------------------------
# Engine level: the prefill logits themselves
# ---------------------------------------------------------------------------------------------

_LOGIT_PROMPTS = [[3, 17, 99, 250, 4, 8, 15, 16, 23, 42], [200, 1, 2], list(range(40, 75))]


def _engine_logits(rank: int, size: int, paths: List[str], addrs: List[str | None], queue: Any) -> None:
    """Prefill logits of each model at tp=size on this rank (a spawned process per rank)."""
    try:
        import dataclasses

        from helpers import PageAllocator, engine_config, make_req, prefill_logits

        from minisgl.engine import Engine

        out = []
        for path, addr in zip(paths, addrs):
            cfg = engine_config(path, max_running_req=4, dist_init_addr=addr, dist_store_hosted=addr is not None)
            engine = Engine(dataclasses.replace(cfg, tp_info=DistributedInfo(rank, size)))
            try:
                alloc = PageAllocator(engine)
                reqs = []
                for row, ids in enumerate(_LOGIT_PROMPTS):
                    alloc.allocate(row, len(ids))
                    reqs.append(make_req(ids, row, output_len=1))
                out.append(prefill_logits(engine, reqs))
            finally:
                engine.shutdown()
        # by value (numpy): a torch tensor crosses a process as a shared-memory fd that the sender
        # must still hold when it is received, and a rank may have exited by then
        queue.put((rank, [t.float().numpy() for t in out]))
    except BaseException as exc:  # report instead of hanging the test
        import traceback

        queue.put((rank, f"{exc}\n{traceback.format_exc()}"))


def _tp2_logits(paths: List[str]) -> Tuple[Any, Dict[int, Any]]:
    """(tp=1 logits computed here, {rank: tp=2 logits or the error text}) for `paths`. This
    process serves each model's rendezvous store (`host_rendezvous`), as LLM(tp=N) does: a port
    merely found free was once taken by another process before rank 0 listened (EADDRINUSE)."""
    import multiprocessing as mp

    from minisgl.distributed import host_rendezvous

    ctx = mp.get_context("spawn")
    ref_q = ctx.Queue()
    _engine_logits(0, 1, paths, [None] * len(paths), ref_q)  # tp=1: no rendezvous
    ref = [torch.from_numpy(a) for a in ref_q.get(timeout=5)[1]]
    stores, addrs = zip(*(host_rendezvous() for _ in paths))
    queue = ctx.Queue()
    procs = [ctx.Process(target=_engine_logits, args=(r, 2, paths, list(addrs), queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: v if isinstance(v, str) else [torch.from_numpy(a) for a in v] for r, v in (queue.get(timeout=240) for _ in procs)}
    for p in procs:
        p.join(30)
    del stores  # kept until every rank is done
    return ref, results


def test_tp2_prefill_logits_within_1e4(tp_model_dir):
    names = sorted(TP_ARCHS)
    paths = [str(tp_model_dir(n)) for n in names]
    ref, results = _tp2_logits(paths)
    assert not isinstance(results[0], str), results[0]
    assert not isinstance(results[1], str), results[1]
    for name, a, b0, b1 in zip(names, ref, results[0], results[1]):
        assert a.shape == b0.shape == (len(_LOGIT_PROMPTS), 301 if name == "qwen2" else 256), name
        assert torch.equal(b0, b1), f"{name}: the two ranks hold different logits"
        diff = float((a - b0).abs().max())
        assert diff < 1e-4, f"{name}: tp=2 prefill logits differ from tp=1 by {diff:.3g}"
        assert torch.equal(a.argmax(-1), b0.argmax(-1)), name


def test_tp_that_does_not_divide_the_model_is_refused(qwen3_dir):
    with pytest.raises(ValueError, match=r"tp=3 cannot split this model: num_attention_heads=4, .* values that fit: \[1, 2, 4\]"):
        LLM(qwen3_dir, tp=3, **_kwargs())


def test_script_without_main_guard_fails_fast_with_a_hint(qwen3_dir):
    start = time.monotonic()
    proc = _run_script("tp_no_main_guard.py", qwen3_dir, timeout=120)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 50  # not the 60 s rendezvous timeout


def test_ctrl_c_during_generate_leaves_the_ranks_usable(qwen3_dir):
    """SIGINT mid-generate at tp=2 raises KeyboardInterrupt between steps; the next generate
    works and the ranks still agree. The script sends the signal after the first tokens, from
    the step loop (tests/scripts/tp_ctrl_c.py), so the outcome does not depend on speed."""
    proc = _run_script("tp_ctrl_c.py", qwen3_dir, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "INTERRUPTED" in proc.stdout.splitlines(), proc.stdout
    assert "AFTER 5 True" in proc.stdout, proc.stdout + proc.stderr[-2000:]


@pytest.mark.skipif(TEST_DEVICE.startswith("cuda") and torch.cuda.device_count() < 4, reason="needs 4 GPUs on CUDA")
def test_tp4_equals_tp1_each_kv_head_on_two_ranks(tmp_path):
    """4 ranks, 4 query heads, 2 KV heads: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1."""
    path = str(build_tiny_model("llama", tmp_path / "llama_tp4", seed=30))
    prompts, params = _workload()
    prompts, params = prompts[:6], params[:6]
    with LLM(path, **_kwargs()) as llm:
        ref = llm.generate(prompts, params)
    with LLM(path, tp=4, **_kwargs()) as llm4:
        assert llm4.scheduler.engine.kv_cache.num_kv_heads == 1
        out = llm4.generate(prompts, params)
        fps = llm4.scheduler.rank_fingerprints()
        assert len(set(fps)) == 1, fps
        assert_idle_and_clean(llm4.scheduler)
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_ATOL


def test_tp_works_after_a_failed_rendezvous_in_the_same_process(qwen3_dir):
    """A timed-out init leaves torch's group counter behind; the next LLM(tp=2) here must still
    meet its fresh worker (it waited for keys nobody wrote before destroy_process_group reset it)."""
    from minisgl.engine import Engine, EngineConfig
    from minisgl.server.process_utils import free_port

    config = EngineConfig(
        model_path=qwen3_dir, tp_info=DistributedInfo(0, 2), dtype=torch.float32, device="cpu",
        distributed_timeout=1, distributed_port=free_port(), num_page_override=16, max_seq_len_override=64,
        max_running_req=2,
    )  # fmt: skip
    with pytest.raises(DistributedInitError):
        Engine(config)
    with LLM(qwen3_dir, tp=2, **_kwargs(distributed_timeout=30)) as llm:
        assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))[0].completion_tokens == 2
