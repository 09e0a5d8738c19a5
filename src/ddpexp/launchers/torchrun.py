"""torchrun: PyTorch's elastic agent, started in this process (elastic_launch), one node or many."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpexp.config import LauncherConfig, check
from ddpexp.launchers import RankFailure, tail


@dataclass
class TorchrunConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.torchrun.launch"
    nnodes: str = "1"  # N or MIN:MAX
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"  # port 0: a free port (single node); multi-node: HOST:PORT on every node
    rdzv_id: str = "ddpexp"
    rdzv_timeout_s: int = 900
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    local_addr: str | None = None

    def __post_init__(self) -> None:
        lo, hi = self.node_range()
        check(1 <= lo <= hi, f"launcher.nnodes={self.nnodes!r}: must be N or MIN:MAX with 1 <= MIN <= MAX")
        check(self.max_restarts >= 0, f"launcher.max_restarts={self.max_restarts}: must be >= 0")
        check(
            hi == 1 or not self.rdzv_endpoint.endswith(":0"),
            f"launcher.nnodes={self.nnodes}: set launcher.rdzv_endpoint=HOST:PORT, the same on every node",
        )

    def node_range(self) -> tuple[int, int]:
        try:
            lo, _, hi = str(self.nnodes).partition(":")
            return int(lo), int(hi or lo)
        except ValueError:
            return 0, 0


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lc = cfg.launcher
    if lc.max_restarts > 0:
        # Restarts over gloo reuse the previous round's TCP store ports and fail to connect (pytorch#135712).
        # The cost: the workers' store port is then picked by bind-and-release, a small race between jobs;
        # without restarts the workers share the agent's store, bound once, and cannot collide.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)  # keeps restart notices
    # It logs every failed rank's traceback; RankFailure below shows the first failure's once.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    min_nodes, max_nodes = lc.node_range()
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=cfg.gpus,
        run_id=lc.rdzv_id,
        rdzv_backend=lc.rdzv_backend,
        rdzv_endpoint=lc.rdzv_endpoint,
        rdzv_configs={"timeout": lc.rdzv_timeout_s},
        max_restarts=lc.max_restarts,
        monitor_interval=lc.monitor_interval_s,
        start_method="spawn",
        local_addr=lc.local_addr,
    )
    try:
        elastic_launch(config, _run_rank)(worker, cfg, job)
    except SignalException as e:
        # Ctrl-C/SIGTERM here: the agent passed it on to the ranks (they checkpoint and stop) and waited for
        # them; the job's summary says where they stopped. A second signal interrupts that wait: exit at once.
        if isinstance(e.__context__, SignalException):
            raise KeyboardInterrupt from None
        logging.getLogger("ddpexp").warning("torchrun agent stopped by %s", e.sigval.name)
        return
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        detail = (
            failure.message.get("extraInfo", {}).get("py_callstack", "") if isinstance(failure.message, dict) else ""
        )
        raise RankFailure(rank, tail(detail or str(failure.message) or f"exit code {failure.exitcode}")) from None


def _run_rank(worker: Callable[..., None], cfg: Any, job: Any) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    record(worker)(cfg, job)


def plan(cfg: Any, job: Any) -> dict[str, Any]:
    from ddpexp.plan import local_ranks, this_command

    lc = cfg.launcher
    lo, hi = lc.node_range()
    world = cfg.gpus if hi == 1 else f"{cfg.gpus}*nnodes({lc.nnodes})"
    node_rank = 0 if hi == 1 else "NODE_RANK(at rendezvous)"
    ranks = local_ranks(cfg, node_rank, world, ("<chosen at rendezvous>", "<chosen at rendezvous>"))
    how = (
        f"elastic agent (rdzv {lc.rdzv_backend} at {lc.rdzv_endpoint}, id {lc.rdzv_id}, max_restarts {lc.max_restarts})"
    )
    return {"command": f"{this_command()}  -> {how} -> ddpexp.worker.main", "ranks": ranks}
