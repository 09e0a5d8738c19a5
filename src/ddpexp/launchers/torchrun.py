"""torchrun: PyTorch's elastic agent, started in this process (elastic_launch), one node or many."""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ddpexp.config import LauncherConfig, check
from ddpexp.exceptions import ConfigError, RankFailure
from ddpexp.launchers.base import Handle, Started, check_resolves, local_ranks, resolve_local, tail, this_command
from ddpexp.launchers.processes import detach_from_terminal, die_with_parent, forward_signals, terminate
from ddpexp.launchers.world import refuse_inside

SWEEP_PARALLEL = "local"  # one node's ranks on this machine: a sweep may run sweep.parallel jobs at once


@dataclass
class TorchrunConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.torchrun.launch"
    nnodes: str = "1"  # N or MIN:MAX
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"  # port 0: a free port (single node); multi-node: HOST:PORT on every node
    rdzv_id: str = "ddpexp"
    rdzv_timeout_s: int = 900  # every node must have joined the rendezvous within this (c10d's join_timeout)
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    local_addr: str | None = None

    def __post_init__(self) -> None:
        lo, hi = self.node_range()
        check(1 <= lo <= hi, f"launcher.nnodes={self.nnodes!r}: must be N or MIN:MAX with 1 <= MIN <= MAX")
        check(self.max_restarts >= 0, f"launcher.max_restarts={self.max_restarts}: must be >= 0")
        check(self.rdzv_timeout_s >= 1, f"launcher.rdzv_timeout_s={self.rdzv_timeout_s}: must be >= 1")
        check(self.monitor_interval_s > 0, f"launcher.monitor_interval_s={self.monitor_interval_s}: must be > 0")
        self.check_backend()
        host, port = self.endpoint()
        check(
            hi == 1 or port != 0,
            f"launcher.nnodes={self.nnodes}: set launcher.rdzv_endpoint=HOST:PORT, the same on every node",
        )

    def check_hosts(self) -> None:
        check_resolves("launcher.rdzv_endpoint", self.endpoint()[0], self.rdzv_endpoint)
        if self.local_addr is not None:
            check_resolves("launcher.local_addr", self.local_addr)

    def check_backend(self) -> None:
        """The rendezvous backends torch's elastic agent registers (torch.distributed.elastic.rendezvous.registry),
        less `static`, which needs a node rank ddpexp does not pass; plugins of the `torchrun.handlers` group."""
        from importlib.metadata import entry_points
        from importlib.util import find_spec

        backend = self.rdzv_backend
        plugins = {ep.name for ep in entry_points(group="torchrun.handlers")}
        if backend in plugins:
            return
        check(
            backend != "static",
            "launcher.rdzv_backend='static': needs a fixed node rank, which ddpexp does not pass; use c10d",
        )
        known = ("c10d", "etcd", "etcd-v2", *sorted(plugins))
        check(backend in known, f"launcher.rdzv_backend={backend!r}: must be one of {', '.join(known)}")
        check(
            not backend.startswith("etcd") or find_spec("etcd") is not None,
            f"launcher.rdzv_backend={backend!r}: needs the python-etcd package (pip install python-etcd) and an "
            "etcd server at launcher.rdzv_endpoint",
        )

    def endpoint(self) -> tuple[str, int | None]:
        """HOST[:PORT] as torch parses it (rendezvous.utils.parse_rendezvous_endpoint); no port: the backend's
        default (c10d 29400, etcd 2379)."""
        text = self.rdzv_endpoint.strip()
        key = f"launcher.rdzv_endpoint={self.rdzv_endpoint!r}"
        check(bool(text), f"{key}: must be HOST:PORT (localhost:0: a free port, single node)")
        if text.startswith("[") and text.endswith("]"):
            host, port_text = text, None
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep:
                host, port_text = text, None
        if len(host) > 1 and host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        port = None
        if port_text is not None:
            check(
                port_text.isdigit() and int(port_text) <= 65535,
                f"{key}: the port must be a number 0..65535 (0: a free one, single node)",
            )
            port = int(port_text)
        check(
            re.fullmatch(r"[\w.:-]+", host) is not None,
            f"{key}: the host must be a name, an IPv4 address or an [IPv6] address",
        )
        return host, port

    def node_range(self) -> tuple[int, int]:
        return node_range(self.nnodes)


def node_range(nnodes: Any) -> tuple[int, int]:
    """`N` or `MIN:MAX` as (MIN, MAX); (0, 0) when it is neither."""
    try:
        lo, _, hi = str(nnodes).partition(":")
        return int(lo), int(hi or lo)
    except ValueError:
        return 0, 0


def resolve(cfg: Any) -> None:
    """Device and ranks per node from the GPUs visible here; the rendezvous (and local) address must resolve."""
    refuse_inside("torchrun")
    resolve_local(cfg)
    cfg.launcher.check_hosts()


def world_size(config: dict[str, Any]) -> int | None:
    """`gpus` per node times a fixed node count; None for an elastic MIN:MAX range."""
    lo, hi = node_range(config.get("launcher", {}).get("nnodes", 1))
    return config["gpus"] * lo if lo == hi and config.get("gpus") is not None else None


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> Handle:
    """The agent runs in this process's main thread (it sets signal handlers), so it starts when the parent waits."""
    return Started(partial(_run_agent, worker, cfg, job))


def _run_agent(worker: Callable[..., None], cfg: Any, job: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
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
        # c10d and etcd-v2 read join_timeout, etcd reads timeout; each ignores keys it does not know.
        rdzv_configs={"join_timeout": lc.rdzv_timeout_s, "timeout": lc.rdzv_timeout_s},
        max_restarts=lc.max_restarts,
        monitor_interval=lc.monitor_interval_s,
        start_method="spawn",
        local_addr=lc.local_addr,
        # The agent's own SIGINT/SIGTERM handling stops the ranks and then waits its shutdown timeout (30 s) for
        # them: a rank that stopped and returned waits, in torch's _wrap, until the agent reads its return value
        # (queue_finished_reading_event, torch/distributed/elastic/multiprocessing/api.py), which only the
        # agent's monitoring does, and that has stopped. So this process hands the signal on itself, as spawn
        # does, and the agent goes on monitoring until the ranks return. The agent keeps SIGHUP and SIGQUIT.
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    if max_nodes > 1:
        more = f"{max_nodes - 1}" if min_nodes == max_nodes else f"{min_nodes - 1} to {max_nodes - 1}"
        print(f"ddpexp: waiting for {more} more node(s) at the rendezvous {lc.rdzv_endpoint} (launcher.nnodes="
              f"{lc.nnodes}), for at most launcher.rdzv_timeout_s={lc.rdzv_timeout_s} s", flush=True)  # fmt: skip
    try:
        with forward_signals(_to_ranks):
            elastic_launch(config, _run_rank)(worker, cfg, job)
    except RendezvousTimeoutError:
        raise ConfigError(
            f"launcher.nnodes={lc.nnodes}: fewer than {min_nodes} node(s) joined the rendezvous at "
            f"{lc.rdzv_endpoint} within launcher.rdzv_timeout_s={lc.rdzv_timeout_s} s; start the same command "
            "(same launcher.rdzv_endpoint and rdzv_id) on every node"
        ) from None
    except SignalException as e:  # SIGHUP/SIGQUIT: the agent passed it on to the ranks and waited for them
        logging.getLogger("ddpexp").warning("torchrun agent stopped by %s", e.sigval.name)
    except ChildFailedError as e:
        # A rank killed by a signal the agent did not send (it ends the others with SIGTERM) is the root cause.
        deaths = [(r, f) for r, f in e.failures.items() if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
        if deaths:
            rank, failure = min(deaths, key=lambda rf: rf[1].timestamp)
            raise RankFailure.by_signal(rank, -failure.exitcode) from None
        rank, failure = e.get_first_failure()
        detail = (
            failure.message.get("extraInfo", {}).get("py_callstack", "") if isinstance(failure.message, dict) else ""
        )
        raise RankFailure(rank, tail(detail or str(failure.message) or f"exit code {failure.exitcode}")) from None


def _to_ranks(signum: int) -> None:
    """The ranks are the processes the agent started here (multiprocessing's children of this process)."""
    import multiprocessing

    terminate([p.pid for p in multiprocessing.active_children()], signum)


def _run_rank(worker: Callable[..., None], cfg: Any, job: Any) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    die_with_parent()
    detach_from_terminal()
    job = replace(job, restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    record(worker)(cfg, job)


def plan(cfg: Any, job: Any) -> dict[str, Any]:
    lc = cfg.launcher
    lo, hi = lc.node_range()
    world = cfg.gpus if hi == 1 else f"{cfg.gpus}*nnodes({lc.nnodes})"
    node_rank = 0 if hi == 1 else "NODE_RANK(at rendezvous)"
    ranks = local_ranks(cfg, node_rank, world, ("<chosen at rendezvous>", "<chosen at rendezvous>"))
    how = (
        f"elastic agent (rdzv {lc.rdzv_backend} at {lc.rdzv_endpoint}, id {lc.rdzv_id}, max_restarts {lc.max_restarts})"
    )
    return {"command": f"{this_command(job)}  -> {how} -> ddpexp.rank.worker.main", "ranks": ranks}
