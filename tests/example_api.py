"""A script as a user writes one, run from the example project's folder by test_example_project: several
ddpexp.run calls in one process, bad input, a run, the same run again, a sweep with a failing job. What each call
returned or raised, and the process state after them, go to the JSON file named by argv[1]."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import ddpexp


def attempt(overrides: list[str], **kwargs: Any) -> dict[str, Any]:
    try:
        result = ddpexp.run(overrides, **kwargs)
    except (ddpexp.ConfigError, ddpexp.RunFailed) as e:
        summaries = getattr(e, "summaries", [])
        return {"raised": type(e).__name__, "message": str(e), "summaries": [described(s) for s in summaries]}
    if isinstance(result, list):
        return {"returned": [described(s) for s in result]}
    return {"returned": described(result)}


def described(summary: ddpexp.Summary | None) -> dict[str, Any] | None:
    return None if summary is None else {"job_dir": summary.job_dir, "record": dict(summary)}


if __name__ == "__main__":  # spawned ranks import this file again
    from hydra.core.global_hydra import GlobalHydra

    handlers_before = len(logging.getLogger().handlers)
    path_before, env_before = list(sys.path), os.environ.get("PYTHONPATH")
    wine = ["experiment=wine", "wandb.mode=disabled"]  # W&B: read back in the CLI's test
    results = {
        "unknown_model": attempt(["model=nope"]),
        "bad_value": attempt([*wine, "batch_size=0"]),
        "one_string": attempt("model=cnn"),  # type: ignore[arg-type]
        "run": attempt([*wine, "debug.check_replicas=true", "hydra.run.dir=api"]),
        "again": attempt([*wine, "debug.check_replicas=true", "hydra.run.dir=api"]),
        # gpus=1 runs its rank in this process, and the calls after it must not mind
        "rank_fails": attempt([*wine, "gpus=1", "debug.fail_at_step=2", "hydra.run.dir=fails"]),
        # job 1's rank fails; the sweep goes on and says so
        "sweep": attempt(
            [*wine, "gpus=1", "debug.fail_at_step=1", "debug.fail_rank=1,0", "hydra.sweep.dir=sweep"], multirun=True
        ),  # fmt: skip
        # batch_size=0 in job 1 stops the sweep before job 0 starts
        "sweep_refused": attempt([*wine, "gpus=1", "batch_size=32,0", "hydra.sweep.dir=refused"], multirun=True),
        "plan": attempt(["plan=true", "hydra.run.dir=plan"]),
    }
    results["after"] = {
        "hydra_initialized": GlobalHydra.instance().is_initialized(),
        "logging_handlers_back": len(logging.getLogger().handlers) == handlers_before,
        "sys_path_back": sys.path == path_before,
        "pythonpath_back": os.environ.get("PYTHONPATH") == env_before,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=2)
