"""What a rank's environment held: a classification task whose metric `probe` is the rank's DDPEXP_PROBE variable
(a number), and a script (argv: a folder) that runs two 2-rank spawn jobs with ddpexp.run in one process, each
under another DDPEXP_PROBE and CPU affinity, and writes what each job's ranks saw, and this process's forkserver
after each job, to FOLDER/probe.json (tests/test_launchers.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ddpexp.parts.tasks import Classification


class EnvProbe(Classification):
    directions = {"loss": "min", "acc": "max", "probe": "max"}

    def metrics(self, model, batch):  # type: ignore[no-untyped-def]
        scores = super().metrics(model, batch)
        n = scores["acc"][1]
        return {**scores, "probe": (torch.tensor(float(os.environ.get("DDPEXP_PROBE", "-1")) * n), n)}


def forkservers() -> list[int]:
    """The forkservers this process started (its children running multiprocessing.forkserver's main)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat, cmdline = (proc / "stat").read_text(), (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"multiprocessing.forkserver" in cmdline:
            found.append(int(proc.name))
    return found


if __name__ == "__main__":  # ranks import this file again (the task): run only as the script
    import ddpexp

    folder, seen = Path(sys.argv[1]), {}
    for value, cores in (("1", [0]), ("2", sorted(os.sched_getaffinity(0)))):
        os.environ["DDPEXP_PROBE"] = value
        os.sched_setaffinity(0, cores)
        summary = ddpexp.run([
            "launcher=spawn", "gpus=2", "task._target_=env_probe.EnvProbe", "max_steps=2", "wandb.mode=disabled",
            f"hydra.run.dir={folder / value}",
        ])  # fmt: skip
        seen[value] = {"probe": summary["final"]["val/probe"], "affinity": summary["cpu_affinity_per_rank"],
                       "cores": cores, "forkservers": forkservers()}  # fmt: skip
    (folder / "probe.json").write_text(json.dumps(seen))
