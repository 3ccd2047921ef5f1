"""Tensor-parallel rank information and collectives."""

from minisgl.distributed.comm import all_gather_last_dim, all_reduce, destroy_process_group, init_process_group
from minisgl.distributed.info import DistributedInfo, get_tp_info, set_tp_info, try_get_tp_info

__all__ = [
    "DistributedInfo",
    "get_tp_info",
    "set_tp_info",
    "try_get_tp_info",
    "all_reduce",
    "all_gather_last_dim",
    "init_process_group",
    "destroy_process_group",
]
