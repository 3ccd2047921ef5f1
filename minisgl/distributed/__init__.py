"""Tensor-parallel rank information and collectives."""

from minisgl.distributed.comm import (
    DistributedInitError,
    all_gather_last_dim,
    all_reduce,
    all_reduce_min_int,
    broadcast,
    broadcast_message,
    destroy_process_group,
    get_cpu_group,
    host_rendezvous,
    init_process_group,
)
from minisgl.distributed.info import DistributedInfo, get_tp_info, set_tp_info, try_get_tp_info

__all__ = [
    "DistributedInfo",
    "DistributedInitError",
    "get_tp_info",
    "set_tp_info",
    "try_get_tp_info",
    "all_reduce",
    "all_gather_last_dim",
    "all_reduce_min_int",
    "broadcast",
    "broadcast_message",
    "get_cpu_group",
    "host_rendezvous",
    "init_process_group",
    "destroy_process_group",
]
