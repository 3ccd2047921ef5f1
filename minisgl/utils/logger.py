"""Logging with rank-0 helpers: in tensor parallelism only rank 0 should narrate."""

from __future__ import annotations

import logging

from minisgl.utils.env import read_env


class RankLogger(logging.LoggerAdapter):
    def info_rank0(self, msg: str, *args: object) -> None:
        from minisgl.distributed import get_tp_info

        if get_tp_info().rank == 0:
            self.info(msg, *args)

    def warning_rank0(self, msg: str, *args: object) -> None:
        from minisgl.distributed import get_tp_info

        if get_tp_info().rank == 0:
            self.warning(msg, *args)


def init_logger(name: str) -> RankLogger:
    logger = logging.getLogger(name)
    root = logging.getLogger("minisgl")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(read_env().log_level)
        root.propagate = False
    return RankLogger(logger, {})


def set_log_level(level: str) -> None:
    init_logger("minisgl")
    logging.getLogger("minisgl").setLevel(level.upper())
