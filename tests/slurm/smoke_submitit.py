"""End-to-end smoke check of submitit against the local test cluster (not collected by pytest).

    tests/slurm/cluster.sh start && eval "$(tests/slurm/cluster.sh env)"
    python tests/slurm/smoke_submitit.py [--nodes 2]

Checks: a tasks_per_node=2 job returns its result and its state goes to COMPLETED; a cancelled
job, a job whose task raises and a job whose process dies without a result are all seen as
finished by submitit (through the sacct stand-in on PATH).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import submitit


def whoami():
    env = submitit.JobEnvironment()
    return dict(
        global_rank=env.global_rank,
        local_rank=env.local_rank,
        node=env.node,
        num_tasks=env.num_tasks,
        hostnames=list(env.hostnames),
        nodename=os.environ.get("SLURMD_NODENAME"),
    )


def boom():
    raise ValueError("expected failure")


def die():
    os._exit(3)  # no result pickle: only sacct can tell submitit the job is over


def wait_done(job, timeout):
    t0 = time.time()
    while not job.done():
        assert time.time() - t0 < timeout, f"job {job.job_id} not done after {timeout}s ({job.state})"
        time.sleep(0.5)
    return time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--tasks-per-node", type=int, default=2)
    args = ap.parse_args()
    assert shutil.which("sacct", path=os.environ["PATH"]).endswith("tests/slurm/bin/sacct"), (
        "stand-in sacct not first on PATH"
    )
    folder = tempfile.mkdtemp(prefix="ddpexp-submitit-")
    ex = submitit.AutoExecutor(folder=folder)
    assert ex.cluster == "slurm", ex.cluster
    ex.update_parameters(nodes=args.nodes, tasks_per_node=args.tasks_per_node, timeout_min=5)

    t0 = time.time()
    job = ex.submit(whoami)
    res = job.results()
    print(f"job {job.job_id}: results in {time.time() - t0:.1f}s")
    for r in res:
        print("  ", r)
    n = args.nodes * args.tasks_per_node
    assert sorted(r["global_rank"] for r in res) == list(range(n)), res
    assert len({r["nodename"] for r in res}) == args.nodes, res
    t1 = time.time()
    while job.state != "COMPLETED":  # result pickle appears before slurm marks the job ended
        assert time.time() - t1 < 60, job.state
        time.sleep(0.5)
    print(f"job {job.job_id}: state COMPLETED {time.time() - t1:.1f}s after result")

    ex.update_parameters(nodes=1, tasks_per_node=1)
    slow = ex.submit(time.sleep, 300)
    while slow.state not in ("RUNNING",):
        time.sleep(0.5)
    slow.cancel()
    dt = wait_done(slow, 60)
    print(f"job {slow.job_id}: cancelled, done after {dt:.1f}s, state={slow.state!r}")
    assert slow.state.startswith("CANCELLED"), slow.state

    for fn, expect in ((boom, "FAILED"), (die, "FAILED")):
        j = ex.submit(fn)
        dt = wait_done(j, 120)
        try:
            j.result()
            raise AssertionError("should have raised")
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as e:
            kind = type(e).__name__
        t1 = time.time()
        while j.state != expect:
            assert time.time() - t1 < 60, j.state
            time.sleep(0.5)
        print(f"job {j.job_id} ({fn.__name__}): done after {dt:.1f}s, {kind}, state={j.state}")
    shutil.rmtree(folder)
    print("OK")


if __name__ == "__main__":
    sys.exit(main())
