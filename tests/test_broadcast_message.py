"""broadcast_message over two gloo ranks: the code and the bytes arrive whole, with no payload,
a payload that rides in the first frame, one exactly at the inline limit, and one past it (the
second broadcast)."""

from __future__ import annotations

import random

import torch.distributed as dist
import torch.multiprocessing as mp

from minisgl.distributed import comm

_rng = random.Random(0)  # the same bytes in every spawned rank (each imports this module)
PAYLOADS = [b"", b"x", bytes(range(256)) * 3, b"\x07" * comm.INLINE_BYTES, _rng.randbytes(comm.INLINE_BYTES + 1), _rng.randbytes(200_000)]


def _rank(rank: int, init_file: str, results: "mp.Queue") -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    comm._CPU_GROUP = dist.group.WORLD
    try:
        for code, data in enumerate(PAYLOADS):
            got = comm.broadcast_message(code, data) if rank == 0 else comm.broadcast_message(0)
            results.put((rank, code, got))
    finally:
        comm._CPU_GROUP = None
        dist.destroy_process_group()


def test_codes_and_payloads_of_every_size_arrive_whole(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(2 * len(PAYLOADS))]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank, code, (back_code, back_data) in got:
        assert back_code == code, (rank, code)
        assert back_data == PAYLOADS[code], (rank, code, len(back_data))
