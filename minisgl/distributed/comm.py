"""Collectives over torch.distributed. With one rank every collective is an identity and no process
group exists, so a tp=1 engine never touches torch.distributed.

Two groups exist when tp > 1:
- the *device group* (the default group: NCCL on CUDA, gloo on CPU) carries the layers'
  all-reduce / all-gather and the broadcast of sampled tokens. On CUDA these are plain NCCL
  collectives on the current stream, which CUDA graphs capture like any kernel (the first one
  runs eagerly, in the graph runner's warm-up forward, so the communicator exists before capture).
- the *CPU group* (gloo) carries host-side agreement: the page-budget minimum at init and the
  scheduler's per-step message broadcast (`broadcast_message`, used by minisgl/scheduler/tp.py). Its timeout is long: between
  two `LLM.generate` calls the follower ranks wait in a broadcast for as long as the user idles.
  A peer that dies closes its TCP connections, so a dead rank still surfaces at once as an error.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Tuple

import torch
import torch.distributed as dist

from minisgl.distributed.info import get_tp_info

# How long a follower may wait in the CPU group for rank 0's next message (an idle offline LLM).
CPU_GROUP_TIMEOUT = timedelta(days=30)

_CPU_GROUP: Any = None


class DistributedInitError(RuntimeError):
    """The ranks could not meet (a rank never joined, the address is wrong or in use)."""


def host_rendezvous(host: str = "127.0.0.1") -> Tuple[Any, str]:
    """Serve the TP ranks' rendezvous store from this process, on a port the OS picks.

    For ranks on this machine started by this process (`LLM(tp=N)`, the server launcher). A port
    merely found free can be taken by another process before rank 0 listens on it (EADDRINUSE,
    seen on a shared machine); this one is bound before any rank starts. Returns the store, which
    must outlive the ranks' start-up (keep it while they run), and its "HOST:PORT"; every rank
    then joins with `store_hosted=True` (EngineConfig.dist_store_hosted)."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, f"{host}:{store.port}"


def init_process_group(addr: str, rank: int, size: int, device: torch.device, timeout_s: float, store_hosted: bool = False) -> Any:
    """Join the TP ranks at `addr` (tcp://host:port). Returns the gloo CPU group.

    Rank 0 serves the rendezvous store at `addr`, unless `store_hosted`: then the process that
    started the ranks serves it (`host_rendezvous`) and every rank joins it as a client.
    Every rank must call this; one that has not joined within `timeout_s` seconds makes the
    others fail with a DistributedInitError that says so, instead of hanging."""
    global _CPU_GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: a bad GPU setup fails here, not mid-forward
    timeout = timedelta(seconds=timeout_s)
    try:
        if store_hosted:
            host, _, port = addr.removeprefix("tcp://").rpartition(":")
            kwargs["store"] = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        else:
            kwargs["init_method"] = addr
        dist.init_process_group(backend=backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
        # Rendezvous and connection set-up of every peer happen in new_group / the first
        # collective, so a missing rank is detected (and timed out) inside this try.
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=CPU_GROUP_TIMEOUT)
        probe = torch.ones(1)
        dist.all_reduce(probe, group=_CPU_GROUP)
        if int(probe.item()) != size:
            raise DistributedInitError(f"expected {size} ranks in the CPU group, counted {int(probe.item())}")
    except DistributedInitError:
        destroy_process_group()
        raise
    except Exception as exc:
        destroy_process_group()
        first = str(exc).splitlines()[0] if str(exc) else ""
        timed_out = isinstance(exc, (TimeoutError, getattr(dist, "DistStoreError", TimeoutError))) or "timed out" in first.lower()
        if timed_out:
            raise DistributedInitError(
                f"tensor-parallel rank {rank} of {size}: the ranks did not all join at {addr} within "
                f"distributed_timeout={timeout_s:g} s ({type(exc).__name__}: {first}). Start every rank "
                "(all --node-rank launchers, with the same --tp and --dist-init-addr), check that the "
                "address is reachable and its port free, or raise distributed_timeout."
            ) from exc
        raise DistributedInitError(
            f"tensor-parallel rank {rank} of {size}: could not set up the {backend} process group at {addr} "
            f"on {device} ({type(exc).__name__}: {first}). On CUDA every rank needs its own GPU "
            "(rank r of a node takes cuda:r); the address must be reachable, and on rank 0 a free port of this machine."
        ) from exc
    return _CPU_GROUP


def destroy_process_group() -> None:
    global _CPU_GROUP
    _CPU_GROUP = None
    if not dist.is_available():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
        return
    # A failed init_process_group (a rank never joined) has already counted the default group,
    # so the next init in this process would name its groups differently from fresh peers' and
    # wait for keys nobody writes. torch resets the counter only when destroying a live group.
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def get_cpu_group() -> Any:
    """The gloo CPU group (None at tp=1)."""
    return _CPU_GROUP


# ---- device collectives (the layers, the sampler) --------------------------------------------
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place (row-parallel linear, vocab-parallel embedding, MoE)."""
    if get_tp_info().size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dimension (vocab-parallel logits)."""
    size = get_tp_info().size
    if size == 1:
        return x
    x = x.contiguous()
    # The gathered tensor is the ranks' shards stacked along dim 0; then move the rank axis last.
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x)
    return out.view(size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


# torch >= 2.10 renamed all_gather_into_tensor (and deprecated the old name)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s `x`, in place."""
    if get_tp_info().size == 1:
        return x
    dist.broadcast(x, src=src)
    return x


# ---- host messages over the CPU group --------------------------------------------------------
# Payloads up to this size ride in the first broadcast (a decode step's plan at batch 256 is a
# few KiB): one gloo round per scheduler step; larger ones take a second round.
INLINE_BYTES = 16 << 10


def broadcast_message(code: int, data: bytes = b"", src: int = 0) -> Tuple[int, bytes]:
    """Send a small code (0 <= code < 256) and optional bytes from rank `src` to every rank of
    the CPU group; returns (code, bytes) on every rank. One gloo broadcast of a fixed-size frame
    carries the code, the byte count and up to INLINE_BYTES of the bytes; only a longer payload
    takes a second broadcast."""
    group = _CPU_GROUP
    assert group is not None, "broadcast_message needs tp > 1 (no CPU group)"
    is_src = dist.get_rank() == src
    frame = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
    if is_src:
        assert 0 <= code < 256, code
        frame[:8] = torch.tensor([(len(data) << 8) | code], dtype=torch.int64).view(torch.uint8)
        if 0 < len(data) <= INLINE_BYTES:
            frame[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(frame, src=src, group=group)
    value = int(frame[:8].view(torch.int64).item())
    code, n = value & 0xFF, value >> 8
    if n > INLINE_BYTES:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if is_src else torch.empty(n, dtype=torch.uint8)
        dist.broadcast(payload, src=src, group=group)
        return code, data if is_src else payload.numpy().tobytes()
    return code, data if is_src else frame[8 : 8 + n].numpy().tobytes()


def all_reduce_min_int(value: int) -> int:
    """The minimum of an integer over the CPU group (the page budget)."""
    if _CPU_GROUP is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())
