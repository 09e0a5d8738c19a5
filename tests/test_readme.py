"""Every shell command in README.md's code blocks is run here, so a documented command cannot break silently:
as written, with `plan=true` or a tiny size appended where a full run is too long (overrides later on the command
line win), on the local Slurm cluster where it names Slurm. A command whose placeholder names what this machine
lacks (a host node0, a partition gpu, CIFAR-10's files, a GPU) must be refused in one clear line. The
`$ command` blocks must print what README shows. A new command in README without a way to run it here fails."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, check_sharded_run, ddpexp_env, read_summary

README = ROOT / "README.md"
DDPEXP = Path(sys.executable).parent / "ddpexp"  # the console script of this environment's install
TINY = ["max_steps=2", "wandb.mode=disabled"]
SEARCH = ["hydra.sweeper.n_trials=1", "gpus=1", "max_steps=2", "wandb.mode=disabled"]  # an Optuna study, 1 trial


@dataclass
class Command:
    text: str  # as README has it (continuation lines joined, the trailing comment cut)
    shown: list[str] | None = None  # a `$ command` block's output lines under it (None: a bash block)
    cwd: str = ""  # a `cd DIR` earlier in the same block


def commands() -> list[Command]:
    """The shell commands of README's code blocks, in order (python and yaml blocks hold code, not commands)."""
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", README.read_text(), re.S):
        if lang in ("python", "yaml"):
            continue
        body = re.sub(r"\\\n\s*", "", body)
        cwd = ""
        for line in body.splitlines():
            line = line.strip()
            if lang != "bash" and not line.startswith("$ "):  # output shown under a `$ command`
                if found and found[-1].shown is not None and line:
                    found[-1].shown.append(line)
                continue
            line = re.sub(r"\s+#\s.*$", "", line.removeprefix("$ ")).strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("cd "):
                cwd = line.split(maxsplit=1)[1]
                continue
            found.append(Command(line, [] if lang != "bash" else None, cwd))
    return found


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 150):  # type: ignore[no-untyped-def]
    program = [str(DDPEXP)] if args[0] == "ddpexp" else [sys.executable, *args[1:]] if args[0] == "python" else args
    rest = args[1:] if args[0] == "ddpexp" else []
    return subprocess.run([*program, *rest], cwd=cwd, env={**ddpexp_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def succeeds(*extra: str, then: Callable[[Path, str], None] | None = None) -> Callable[..., None]:
    """Run as written plus `extra`; exit 0 (and `then(workdir, stdout)` holds)."""

    def check(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
        proc = run([*shlex.split(cmd.text), *extra], work / cmd.cwd, env)
        assert proc.returncode == 0, f"{cmd.text}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if then is not None:
            then(work, proc.stdout)

    return check


def refused(message: str, *extra: str) -> Callable[..., None]:
    """Run as written plus `extra`: one error line naming what this machine lacks, exit 2 (warnings about the
    command as written, e.g. 8 ranks on 2 cores, may come before it)."""

    def check(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
        proc = run([*shlex.split(cmd.text), *extra], work / cmd.cwd, env)
        *warnings, error = proc.stderr.strip().splitlines() or [""]
        assert proc.returncode == 2 and message in error, f"{cmd.text}\n{proc.stderr}"
        assert all(": warning: " in line for line in warnings), f"{cmd.text}\n{proc.stderr}"

    return check


def prints_what_readme_shows(*extra: str, exit_code: int) -> Callable[..., None]:
    """A `$ command` block: its stderr is the line README shows ("..." stands for the run's own paths, N for a
    rank's number)."""

    def check(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
        proc = run([*shlex.split(cmd.text), *extra], work, env)
        assert proc.returncode == exit_code, proc.stderr
        pattern = re.escape(cmd.shown[0]).replace(r"\.\.\.", ".*").replace("rank\\ 0", "rank\\ [0-9]")
        assert re.fullmatch(pattern, proc.stderr.strip().splitlines()[-1]), (cmd.shown[0], proc.stderr)

    return check


def pytest_is_this_suite(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """README's test command is what .ci/run runs, verbatim (it runs this very file)."""
    assert cmd.text in (ROOT / ".ci" / "run").read_text()


def installs_then_trains(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """README's first command: the install is test_package's (a real wheel, installed elsewhere); its last part,
    the default job, runs here with the installed console script."""
    last = cmd.text.split("&&")[-1].strip()
    assert last == "ddpexp" and "pip install ." in cmd.text
    succeeds(*TINY, "hydra.run.dir=first")(Command(last), work, env)
    assert read_summary(work / "first")["status"] == "completed"


def brier_task(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """The task example: README's own mypkg/tasks.py (the python block before it), on the command line shown."""
    code = re.search(r"```python\n# mypkg/tasks.py\n(.*?)```", README.read_text(), re.S)
    assert code, "README's mypkg/tasks.py block"
    (work / "mypkg").mkdir(exist_ok=True)
    (work / "mypkg" / "__init__.py").write_text("")
    (work / "mypkg" / "tasks.py").write_text(code.group(1))
    succeeds(*TINY, "gpus=1", "hydra.run.dir=brier")(cmd, work, {**(env or {}), "PYTHONPATH": str(work)})
    assert "val/brier" in read_summary(work / "brier")["final"]


def report_of(*runs: str) -> Callable[..., None]:
    """`ddpexp report` of the job dirs it names, made first (tiny default runs) if an earlier command did not."""

    def check(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
        for path in runs:
            if not (work / path / "summary.json").exists() and not (work / path).is_dir():
                assert run(["python", "-m", "ddpexp", "gpus=1", *TINY, f"hydra.run.dir={path}"], work).returncode == 0
        succeeds(then=lambda w, out: None)(cmd, work, env)
        assert (work / os.path.commonpath([*runs]) / "report.md").exists() or (work / runs[0] / "report.md").exists()

    return check


def lowest_mse_first(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """The diabetes sweep's report: minimize, the job of the lowest val/mse named best."""
    sweep = work / "multirun" / "diabetes"
    if not sweep.is_dir():  # this command alone (-k): README's sweep command before it first
        made = next(c for c in ALL if c.text.endswith("hydra.sweep.dir=multirun/diabetes"))
        succeeds("gpus=1", "wandb.mode=disabled")(made, work, env)
    mse = {i: read_summary(sweep / str(i))["final"]["val/mse"] for i in range(2)}
    best = min(mse, key=lambda i: mse[i])
    proc = run(shlex.split(cmd.text), work, env)
    assert proc.returncode == 0, proc.stderr
    assert "objective val/mse (minimize)" in proc.stdout and f"best: job {best}, val/mse=" in proc.stdout, proc.stdout


def best_kept(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """The early-stopping command as written, on one rank: best.pt and summary.json's `best` agree."""
    succeeds("gpus=1", "wandb.mode=disabled", "hydra.run.dir=early")(cmd, work, env)
    summary = read_summary(work / "early")
    assert summary["best"]["checkpoint"] == str(work / "early" / "checkpoints" / "best.pt"), summary
    assert summary["stopped_early"] is False and summary["early_stop"]["patience"] == 3, summary


def scores_the_test_split(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """`ddpexp eval` of README's run with a test split (made first, tiny, when this command runs alone)."""
    job = work / "outputs" / "digits_test"
    if not (job / "checkpoints" / "best.pt").exists():
        made = next(c for c in ALL if c.text.endswith("hydra.run.dir=outputs/digits_test"))
        succeeds(*TINY)(made, work, env)
    succeeds()(cmd, work, env)
    record = json.loads((job / "eval" / "best-test-1.json").read_text())
    assert (record["split"], record["scored"], record["world_size"]) == ("test", 180, 2), record


def from_elsewhere(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """`--config-dir path/to/myproject/conf`: the project's real path, from another directory."""
    text = cmd.text.replace("path/to/myproject", str(work / "examples" / "myproject"))
    elsewhere = work / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    succeeds("plan=true")(Command(text), elsewhere, env)


def started_by(launcher: str) -> Callable[..., None]:
    """A command that an outside launcher starts (launcher=env): torchrun and srun as written, with this
    environment's Python; the PyTorchJob form as both of its pods, RANK=1 as well, on a free port."""

    def check(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
        words = shlex.split(cmd.text)
        words = [sys.executable if w == "python" else w for w in words]
        if words[0] == "torchrun":
            words[:1] = [sys.executable, "-m", "torch.distributed.run"]
        assigned = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S+", w))
        words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S+", w)]
        job = f"by_{launcher}"
        full = {**ddpexp_env(), **(env or {})}
        others = []
        if assigned:
            with __import__("socket").socket() as sock:
                sock.bind(("127.0.0.1", 0))
                assigned["MASTER_PORT"] = str(sock.getsockname()[1])
            others = [subprocess.Popen([*words, *TINY, f"hydra.run.dir={job}"], cwd=work,
                                       env={**full, **assigned, "RANK": "1"}, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)]  # fmt: skip
        proc = subprocess.run([*words, *TINY, f"hydra.run.dir={job}"], cwd=work, env={**full, **assigned},
                              capture_output=True, text=True, timeout=150)  # fmt: skip
        for other in others:
            assert other.wait(timeout=60) == 0, other.communicate()
        assert proc.returncode == 0, f"{cmd.text}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        summary = read_summary(work / job)
        assert (summary["status"], summary["started_by"], summary["world_size"]) == ("completed", launcher, 2)

    return check


def extras_declared(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """`pip install -e ".[tensorboard,mlflow]"`: those extras exist, and the test extra (installed here) holds
    what they install, so the suite runs each tracker against the package its extra brings."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = re.search(r"\[([\w,]+)\]", cmd.text).group(1).split(",")  # type: ignore[union-attr]
    assert named == ["tensorboard", "mlflow"] and all(set(extras[n]) <= set(extras["test"]) for n in named)


def optuna_on_slurm(cmd: Command, work: Path, env: dict[str, str] | None) -> None:
    """Two trials of 2 ranks, each a Slurm job, each waited for where it was submitted when the sweeper reads its
    value (the basic sweeper's deferred waiting would hand Optuna no value at all); the best is the lowest loss."""
    sweep = work / "optuna_slurm"
    extra = ["hydra.sweeper.n_trials=2", "gpus=2", "launcher.poll_interval_s=0.5", "max_steps=5"]
    succeeds(*extra, "wandb.mode=disabled", f"hydra.sweep.dir={sweep}")(cmd, work, env)
    summaries = [read_summary(sweep / str(i)) for i in range(2)]
    assert [(s["status"], s["world_size"], s["steps"]) for s in summaries] == [("completed", 2, 5)] * 2
    assert len({s["slurm"]["job_id"] for s in summaries}) == 2
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == min(s["final"]["val/loss"] for s in summaries)


# (pattern of the command, what to do, needs the Slurm cluster)
WAYS: list[tuple[str, Callable[..., None], bool]] = [
    (r"python3 -m venv .* pip install \. && ddpexp$", installs_then_trains, False),
    (r"python3 -m venv .* pip install -e \"\.\[test\]\" && python -m pytest$", pytest_is_this_suite, False),
    (r"python -m ddpexp launcher=spawn gpus=8$", succeeds("plan=true"), False),
    (r"python -m ddpexp launcher=torchrun gpus=4 model=resnet50 data=cifar10 .*", succeeds("plan=true"), False),
    (r"python -m ddpexp -m optimizer\.lr=1e-3,3e-3 model=cnn,resnet18$", succeeds("plan=true"), False),
    (r"python -m ddpexp experiment=mnist_resnet101 data\.download=true$", succeeds("plan=true"), False),
    (r"python -m ddpexp --cfg job$", succeeds(then=lambda w, out: "batch_size: 64" in out or pytest.fail(out)), False),
    (r"pip install -e \"\.\[tensorboard,mlflow\]\"$", extras_declared, False),
    (r"python -m ddpexp 'tracker=\[wandb,tensorboard,mlflow\]'$", succeeds("plan=true"), False),  # test_trackers.py
    (r"python -m ddpexp model=resnet2$", prints_what_readme_shows(exit_code=2), False),
    (r"python -m ddpexp batch_size=0$", prints_what_readme_shows(exit_code=2), False),
    (r"python -m ddpexp \+optimzer\.lr=0\.1$", prints_what_readme_shows(exit_code=2), False),
    (r"python -m ddpexp -m optimizer\.lr=1e-3,-1$", prints_what_readme_shows(exit_code=2), False),
    (r"python -m ddpexp -m sweep\.parallel=2 gpus=1 optimizer\.lr=1e-3,1e-2 hydra\.sweep\.dir=multirun/parallel$",
     succeeds("plan=true"), False),  # run for real, Ctrl-C and resume included: tests/test_parallel.py
    (r"python -m ddpexp epochs=2 objective=val/loss early_stop\.patience=3 early_stop\.min_delta=0\.001$",
     best_kept, False),
    (r"python -m ddpexp objective=val/loss data\.test_fraction=0\.1 hydra\.run\.dir=outputs/digits_test$",
     succeeds(*TINY), False),
    (r"python -m ddpexp eval outputs/digits_test --split test$", scores_the_test_split, False),
    (r"python -m ddpexp optimizer\.lr=1e30 checkpoint_every_n_steps=1$",
     prints_what_readme_shows("max_steps=4", "wandb.mode=disabled", "hydra.run.dir=nan", exit_code=1), False),
    (r".*launcher\.rdzv_endpoint=node0:29400$", refused("cannot resolve host 'node0'", "plan=true"), False),
    (r".*launcher=slurm gpus=8 launcher\.nodes=4 launcher\.partition=gpu .*", refused("'gpu'", "plan=true"), True),
    (r"python -m ddpexp -m launcher=slurm optimizer\.lr=1e-3,1e-2,1e-1$", succeeds("plan=true"), True),
    (r"python -m ddpexp task\._target_=mypkg\.tasks\.BrierTask .*", brier_task, False),
    (r"python -m ddpexp model=mlp model\._target_=mypkg\.nets\.MyNet .*", succeeds("plan=true"), False),
    (r"ddpexp experiment=wine$", succeeds("plan=true"), False),  # run: test_example_project.py
    (r"ddpexp experiment=wine model=mlp$", succeeds("plan=true"), False),
    (r"ddpexp experiment=wine launcher=nice launcher\.niceness=15$",
     succeeds("plan=true", then=lambda w, out: "launcher=nice, 2 rank(s)" in out or pytest.fail(out)),
     False),  # its ranks run niced, and the record says so: test_launchers.py's TestProjectLauncher
    (r"ddpexp -m experiment=wine optimizer\.lr=3e-3,1e-2$", succeeds("plan=true"), False),
    (r"ddpexp --config-dir path/to/myproject/conf experiment=wine$", from_elsewhere, False),
    (r"torchrun --standalone --nproc_per_node=2 -m ddpexp data=digits epochs=2$", started_by("torchrun"), False),
    (r"srun -N1 -n2 python -m ddpexp data=digits epochs=2$", started_by("srun"), True),
    (r"MASTER_ADDR=\S+ MASTER_PORT=\d+ WORLD_SIZE=2 RANK=0 python -m ddpexp data=digits epochs=2$", started_by("env"),
     False),
    (r"python -m ddpexp model=resnet18 data=cifar10 hydra\.run\.dir=.*", refused("CIFAR10 not found"), False),
    (r"python -m ddpexp -m optimizer\.lr=1e-3,1e-2 hydra\.sweep\.dir=multirun/2026-12-02/10-00-00$",
     succeeds("gpus=1", *TINY), False),
    (r"python -m ddpexp\.bench --device cuda .*", refused("0 GPUs visible", "--plan"), False),
    (r"python -m ddpexp\.bench .*", succeeds("--plan"), False),
    (r"python -m ddpexp\.bench\.strategies.*", succeeds("--plan"), False),  # the jobs themselves: test_fsdp2.py
    (r"python -m ddpexp strategy=fsdp2 gpus=2$", succeeds(*TINY, "hydra.run.dir=fsdp2", then=lambda w, out: check_sharded_run(w / "fsdp2", 2)),
     False),
    (r"python -m ddpexp hparams_search=digits_optuna launcher=slurm .*", optuna_on_slurm, True),
    (r"python -m ddpexp hparams_search=digits_optuna.*", succeeds(*SEARCH), False),
    (r"python -m ddpexp report multirun/2026-12-02/10-00-00$", report_of("multirun/2026-12-02/10-00-00"), False),
    (r"python -m ddpexp -m experiment=diabetes_mlp optimizer\.lr=1e-4,1e-2 epochs=3 hydra\.sweep\.dir=multirun/diabetes$",
     succeeds("gpus=1", "wandb.mode=disabled"), False),
    (r"python -m ddpexp report multirun/diabetes$", lowest_mse_first, False),
    (r"python -m ddpexp report outputs/2026-12-02/10-00-00 outputs/2026-12-02/11-30-00$",
     report_of("outputs/2026-12-02/10-00-00", "outputs/2026-12-02/11-30-00"), False),
]  # fmt: skip
ALL = commands()


def way(cmd: Command) -> tuple[Callable[..., None], bool]:
    matches = [(check, slurm) for pattern, check, slurm in WAYS if re.fullmatch(pattern, cmd.text)]
    assert matches, f"README command with no way to run it here: {cmd.text}"
    return matches[0]


def test_every_readme_command_has_a_way_to_run_here() -> None:
    assert len(ALL) >= 30
    for cmd in ALL:
        way(cmd)
    assert all(cmd.shown for cmd in ALL if cmd.shown is not None), "a `$ command` block shows its output"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for all of README's commands, in README's order, with a copy of examples/ (README cds there)."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    return root


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cmd", ALL, ids=[c.text[:80] for c in ALL])
def test_readme_command(cmd: Command, work: Path, request: pytest.FixtureRequest) -> None:
    check, needs_slurm = way(cmd)
    env = request.getfixturevalue("slurm") if needs_slurm else None
    check(cmd, work, env)
