"""ray: the ranks as plain Ray actors in one placement group (all start or none), on a running Ray cluster or on a
local Ray runtime started for this command; each actor sets env:// and calls the worker, rank 0's hosts the store."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ddpexp.config import LauncherConfig, check
from ddpexp.exceptions import ConfigError, Interrupted, RankFailure
from ddpexp.job import read_json
from ddpexp.launchers.base import Handle, resolve_local, tail, this_command
from ddpexp.launchers.processes import STOP_SIGNALS, forward_signals, terminate
from ddpexp.launchers.world import refuse_inside

PLACEMENTS = ("PACK", "SPREAD", "STRICT_SPREAD")
PASSED_ON = ("WANDB_", "DDPEXP_")  # the command's variables every rank gets (a rank's env is its raylet's)


@dataclass
class RayConfig(LauncherConfig):
    _target_: str = "ddpexp.launchers.ray.launch"
    address: str | None = None  # null: RAY_ADDRESS if set, else a local Ray runtime; HOST:PORT or ray://HOST:PORT
    nodes: int = 1  # world size = gpus x nodes
    placement: str = "PACK"  # the placement group's strategy: PACK, SPREAD or STRICT_SPREAD (one rank per node)
    cpus_per_rank: float = 1
    runtime_env: dict[str, Any] = field(default_factory=dict)  # Ray's runtime_env for every rank (pip, env_vars...)
    max_restarts: int = 0  # a rank that fails or dies restarts the whole gang from the last checkpoint, this often
    connect_timeout_s: float = 5.0
    poll_interval_s: float = 0.5

    def __post_init__(self) -> None:
        check(self.nodes >= 1, f"launcher.nodes={self.nodes}: must be >= 1")
        check(self.placement in PLACEMENTS, f"launcher.placement={self.placement!r}: must be one of {PLACEMENTS}")
        check(self.cpus_per_rank > 0, f"launcher.cpus_per_rank={self.cpus_per_rank}: must be > 0")
        check(self.max_restarts >= 0, f"launcher.max_restarts={self.max_restarts}: must be >= 0")
        check(self.connect_timeout_s > 0, f"launcher.connect_timeout_s={self.connect_timeout_s}: must be > 0")
        check(self.poll_interval_s > 0, f"launcher.poll_interval_s={self.poll_interval_s}: must be > 0")

    def cluster(self) -> str | None:
        """The cluster's address, None for a local runtime of this command."""
        return self.address or os.environ.get("RAY_ADDRESS") or None


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("launcher=ray needs Ray: pip install 'ddpexp[ray]'") from None
    return ray


def resolve(cfg: Any) -> None:
    """Connect (a dead address is one line, not Ray's minutes of retries), pin `device` and `gpus` from what the
    cluster has, and refuse a gang the cluster can never place. plan=true without an address starts no runtime:
    this machine's GPUs stand for the local runtime's."""
    refuse_inside("ray")
    ray, lc = _ray(), cfg.launcher
    if cfg.plan and lc.cluster() is None:
        resolve_local(cfg)
        return
    connect(ray, lc)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    gpus = max((int(r.get("GPU", 0)) for r in nodes), default=0)
    if cfg.device == "cuda" and gpus == 0:
        raise ConfigError(f"device=cuda: the Ray cluster {where(lc)} has no GPUs; use device=cpu (or device=auto)")
    cfg.device = cfg.device if cfg.device != "auto" else ("cuda" if gpus else "cpu")
    cfg.gpus = cfg.gpus or (gpus if cfg.device == "cuda" else 2)
    need = bundle(cfg)
    fits = [min(int(r.get(k, 0) // v) for k, v in need.items()) for r in nodes]
    places = sum(min(f, 1) for f in fits) if lc.placement == "STRICT_SPREAD" else sum(fits)
    world = cfg.gpus * lc.nodes
    if world > places:
        raise ConfigError(
            f"gpus={cfg.gpus} x launcher.nodes={lc.nodes}: {world} ranks of {need} each, but the Ray cluster "
            f"{where(lc)} can place at most {places} ({lc.placement} over {len(nodes)} node(s)); ask for fewer"
        )


def where(lc: Any) -> str:
    return f"at {lc.cluster()}" if lc.cluster() else "(a local runtime of this command)"


def connect(ray: Any, lc: Any) -> None:
    if ray.is_initialized():
        return
    address = lc.cluster()
    if address is not None and address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host or address, int(port or 6379)), timeout=lc.connect_timeout_s).close()
        except (OSError, ValueError) as e:
            raise ConfigError(f"launcher.address={address!r}: no Ray cluster answers there ({e}); start one "
                              "(`ray start --head`) or leave it null for a local Ray runtime") from None  # fmt: skip
    # Rank 0's lines come from its log file (Handle.wait), without Ray's per-actor prefixes.
    try:
        ray.init(address=address or "local", log_to_driver=False, logging_level="WARNING", include_dashboard=False)
    except ConnectionError as e:  # address=auto with no cluster on this machine, a port that is not Ray's
        raise ConfigError(f"launcher.address={address!r}: cannot connect to Ray there ({e})") from None


def bundle(cfg: Any) -> dict[str, float]:
    return {"CPU": cfg.launcher.cpus_per_rank, **({"GPU": 1} if cfg.device == "cuda" else {})}


def world_size(config: dict[str, Any]) -> int | None:
    """`gpus` ranks times `launcher.nodes`."""
    gpus = config.get("gpus")
    return gpus * config.get("launcher", {}).get("nodes", 1) if gpus is not None else None


class Rank:
    """One rank: a Ray actor. Its methods run in the actor process's main thread, where the worker's stop
    signals (rank/signals.py) can be set."""

    def place(self) -> dict[str, Any]:
        import ray

        # A stop signal that comes before the worker's handlers waits (as under spawn: stop_signals_blocked).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        context = ray.get_runtime_context()
        return {"node": context.get_node_id(), "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def host_store(self) -> tuple[str, int]:
        """The rendezvous store, bound on port 0 here: no race for a port between jobs (as spawn's)."""
        import ray
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        return host, self.store.port

    def run(self, worker: Callable[..., None], cfg: Any, job: Any, rank: int, master: Any, *places: Any) -> str:
        mine = places[rank]
        here = [p for p in places if p["node"] == mine["node"]]
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(here.index(mine)), WORLD_SIZE=str(len(places)),
            LOCAL_WORLD_SIZE=str(len(here)), MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )  # fmt: skip
        if mine["gpus"]:  # Ray shows each actor its own GPU only: show this node's, cuda:LOCAL_RANK being its own
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(p["gpus"][0] for p in here)
        return worker(cfg, job)


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> Handle:
    """Submits the gang and returns: a sweep submits every job (each its own placement group) before waiting."""
    return RayJob(worker, cfg, job)


class RayJob:
    """The Handle of a submitted gang: `wait` follows rank 0's log, hands a stop signal on to the ranks' processes,
    restarts the gang after a failure (launcher.max_restarts) and raises RankFailure when none is left."""

    queued = True

    def __init__(self, worker: Callable[..., None], cfg: Any, job: Any):
        from ray.util.placement_group import placement_group

        self.ray, self.worker, self.cfg, self.job = _ray(), worker, cfg, job
        lc, self.actors, self.signals = cfg.launcher, [], []  # signals: received, then None once handed on
        self.world = cfg.gpus * lc.nodes
        self.group = placement_group([bundle(cfg)] * self.world, strategy=lc.placement)
        log = job.log_path(0)
        self.offset = os.path.getsize(log) if os.path.exists(log) else 0
        self.start(restarts=0)
        print(f"ddpexp: submitted {self.world} rank(s) to Ray {where(lc)} (placement group {lc.placement})", flush=True)

    def start(self, restarts: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        lc, actor = self.cfg.launcher, self.ray.remote(Rank)
        env = dict(lc.runtime_env)
        env["env_vars"] = {
            **{k: v for k, v in os.environ.items() if k.startswith(PASSED_ON)},
            **env.get("env_vars", {}),
        }
        self.actors = [
            actor.options(
                num_cpus=lc.cpus_per_rank, num_gpus=1 if self.cfg.device == "cuda" else 0, runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            ).remote()
            for i in range(self.world)
        ]  # fmt: skip
        self.places = [a.place.remote() for a in self.actors]
        master = self.actors[0].host_store.remote()
        job = replace(
            self.job,
            restarts=restarts,
            record={**self.job.record, "ray": {"placement": lc.placement, "restarts": restarts}},
        )
        self.runs = [
            a.run.remote(self.worker, self.cfg, job, r, master, *self.places) for r, a in enumerate(self.actors)
        ]
        self.restarts = restarts

    def wait(self) -> None:
        try:
            with forward_signals(self.signals.append):
                while not self._round():
                    self._restart()
        finally:
            self._stop()
            self._echo()

    def _round(self) -> bool:
        """Until every rank returned (True) or one failed and the gang may restart (False)."""
        while True:
            done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=self.cfg.launcher.poll_interval_s)
            self._echo()
            self._hand_on_signals()
            failure = self._failure(done)
            if failure is not None:
                failure = self._let_the_others_end(done) or failure
                if self.restarts >= self.cfg.launcher.max_restarts or self.signals:
                    raise failure
                print(f"ddpexp: {str(failure).splitlines()[0]}; restarting the gang from the last checkpoint "
                      f"({self.restarts + 1} of launcher.max_restarts={self.cfg.launcher.max_restarts})", flush=True)  # fmt: skip
                return False
            if len(done) == len(self.runs):
                return True

    def _failure(self, done: list[Any]) -> RankFailure | None:
        """The first rank whose process died, else the one that raised first (its error file's time): a death or
        the first error is the root cause of the others' gloo errors."""
        died, raised = [], []
        for ref in done:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError as e:  # its process died (a signal, out of memory)
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                died.append(RankFailure(self.runs.index(ref), f"its process died ({why})", died=True))
            except self.ray.exceptions.RayTaskError as e:  # the rank raised: its traceback
                raised.append(RankFailure(self.runs.index(ref), tail(str(e))))
        raised.sort(key=lambda f: (read_json(self.job.error_path(f.rank)) or {}).get("time", float("inf")))
        return (died + raised)[0] if died or raised else None

    def _let_the_others_end(self, ended: list[Any]) -> RankFailure | None:
        """The other ranks get GRACE_S to fail on their own, as under spawn; then go. The ended ranks' actors go
        first: a rank that raised keeps its process, whose open sockets would hide its going from gloo. Returns
        the root cause among all that ended (a death seen after its peers' errors)."""
        for ref in ended:
            self.ray.kill(self.actors[self.runs.index(ref)], no_restart=True)
        done, _ = self.ray.wait(self.runs, num_returns=len(self.runs), timeout=GRACE_S)
        failure = self._failure(done)
        self._stop(keep_group=True)
        return failure

    def _restart(self) -> None:
        for rank in range(self.world):  # the earliest error file names the root cause: only this attempt's count
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.job.error_path(rank))
        self.start(self.restarts + 1)

    def _hand_on_signals(self) -> None:
        """The first Ctrl-C/SIGTERM, to the ranks' processes (the actors'), by a task on each of their nodes."""
        if not self.signals or self.signals[-1] is None:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ready, _ = self.ray.wait(self.places, num_returns=len(self.places), timeout=0)
        if len(ready) < len(self.places):  # not every rank placed: none has started, nothing to checkpoint
            name = signal.Signals(self.signals[0]).name
            raise Interrupted(f"interrupted by {name} before every rank was placed (the cluster's resources were "
                              "not free): nothing ran; the same command starts the job again")  # fmt: skip
        signum, by_node = self.signals[0], {}
        for place in self.ray.get(self.places):
            by_node.setdefault(place["node"], []).append(place["pid"])
        sent = [
            self.ray.remote(num_cpus=0)(terminate)
            .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(pids, signum)
            for node, pids in by_node.items()
        ]
        self.ray.get(sent, timeout=60)
        self.signals.append(None)  # handed on

    def _stop(self, keep_group: bool = False) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []
        if not keep_group:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)

    def _echo(self) -> None:
        """Rank 0's new log records (it writes them to the job dir, which this machine sees); a traceback's lines
        there are left out: the command shows the failing rank's once, as its error."""
        path = self.job.log_path(0)
        if not os.path.exists(path):
            return
        with open(path, "rb") as f:
            f.seek(self.offset)
            text = f.read()
        whole = text[: text.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(whole)
        lines = whole.decode(errors="replace").splitlines(True)
        sys.stdout.write("".join(line for line in lines if line.startswith("[")))
        sys.stdout.flush()


GRACE_S = 5.0


def plan(cfg: Any, job: Any) -> dict[str, Any]:
    lc = cfg.launcher
    world = cfg.gpus * lc.nodes
    how = (f"Ray {where(lc)}: placement group of {world} x {bundle(cfg)} ({lc.placement}), one actor per rank, "
           f"launcher.max_restarts={lc.max_restarts}")  # fmt: skip
    ranks = []
    for rank in range(world):
        ranks.append({"RANK": str(rank), "LOCAL_RANK": "<its index on its node>", "WORLD_SIZE": str(world),
                      "LOCAL_WORLD_SIZE": "<ranks on its node>", "MASTER_ADDR": "<rank 0's node>",
                      "MASTER_PORT": "<bound by rank 0's actor>"})  # fmt: skip
    return {"command": f"{this_command(job)}  -> {how} -> ddpexp.rank.worker.main", "ranks": ranks}
