"""Every conf/ option composes into a typed Config; bad input fails with one clear line before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import ROOT, ddpexp_env, make_config, run_ddpexp
from ddpexp.config import Config
from ddpexp.exceptions import ConfigError
from ddpexp.launchers import launcher_schemas

CONF = ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml")) if not f.stem.startswith("base_")]


def test_groups_present() -> None:
    assert {"launcher", "model", "data", "optimizer", "scheduler", "experiment"} <= set(GROUPS)
    assert {"spawn", "torchrun"} <= {name for g, name in OPTIONS if g == "launcher"}


@pytest.mark.parametrize(("group", "name"), OPTIONS, ids=[f"{g}={n}" for g, n in OPTIONS])
def test_every_option_composes(group: str, name: str) -> None:
    cfg = make_config(f"{group}={name}")
    assert isinstance(cfg, Config)
    if group == "launcher":  # one module + one dataclass + one YAML per launcher
        assert type(cfg.launcher) is launcher_schemas()[name]
        assert cfg.launcher._target_ == f"ddpexp.launchers.{name}.launch"


def test_launcher_modules_have_yaml_and_the_parent_s_functions() -> None:
    import importlib

    assert set(launcher_schemas()) == {name for g, name in OPTIONS if g == "launcher"}
    for name in launcher_schemas():
        module = importlib.import_module(f"ddpexp.launchers.{name}")
        assert all(callable(getattr(module, f, None)) for f in ("launch", "plan", "resolve", "world_size")), name


MODEL_SHAPES = [
    (name, shape)
    for name in (n for g, n in OPTIONS if g == "model" and n != "gpt")  # gpt reads tokens: see below
    for shape in [(1, 28), (3, 32), (1, 8)]
    if not (shape == (1, 8) and name in ("resnet50", "resnet101"))  # one 8-px ResNet (resnet18) is enough
]


@pytest.mark.parametrize(("name", "shape"), MODEL_SHAPES, ids=[f"{n}-{c}x{s}" for n, (c, s) in MODEL_SHAPES])
def test_models_fit_the_data_shape(name: str, shape: tuple[int, int]) -> None:
    import torch

    from ddpexp.parts.optim import call_accepting

    in_channels, size = shape
    cfg = make_config(f"model={name}")
    model = call_accepting(
        instantiate(cfg.model, _partial_=True), num_classes=7, in_channels=in_channels, image_size=size
    )
    assert model(torch.zeros(2, in_channels, size, size)).shape == (2, 7)


def test_gpt_is_causal_and_fits_the_text_data() -> None:
    import torch

    from ddpexp.parts.optim import call_accepting

    cfg = make_config("model=gpt", "data=stdlib_text", "task=language_model", "data.block_size=16")
    model = call_accepting(instantiate(cfg.model, _partial_=True), vocab_size=98, block_size=16).eval()
    tokens = torch.randint(0, 98, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 98
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, 98)
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.equal(a[:, 10:], b[:, 10:])  # no peeking ahead
    assert model.lm_head.weight is model.wte.weight


def test_tutorial_preset_reproduces_the_seed_setup() -> None:
    cfg = make_config("experiment=mnist_resnet101")
    assert cfg.model["arch"] == "resnet101" and cfg.model["stem"] == "imagenet"
    assert cfg.data["name"] == "MNIST" and cfg.optimizer["_target_"] == "torch.optim.Adam"
    assert (cfg.batch_size, cfg.epochs, cfg.optimizer["lr"]) == (256, 10, 1e-3)
    model = call_model(cfg)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.in_channels == 1


def call_model(cfg: Config):  # type: ignore[no-untyped-def]
    from ddpexp.parts.optim import call_accepting

    return call_accepting(instantiate(cfg.model, _partial_=True), num_classes=10, in_channels=1, image_size=28)


def test_command_line_overrides_win_over_presets() -> None:
    cfg = make_config("experiment=cifar10_resnet18", "batch_size=7", "optimizer.lr=0.5")
    assert (cfg.batch_size, cfg.optimizer["lr"], cfg.scheduler["warmup_steps"]) == (7, 0.5, 200)


def test_optimizers_and_schedulers_build() -> None:
    import torch

    from ddpexp.parts.optim import call_accepting

    params = [torch.nn.Parameter(torch.zeros(3))]
    for name, cls in [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)]:
        assert type(instantiate(make_config(f"optimizer={name}").optimizer)(params)) is cls
    cfg = make_config("optimizer=sgd", "optimizer.lr=1.0", "scheduler=cosine", "scheduler.warmup_steps=2")
    opt = instantiate(cfg.optimizer)(params)
    sched = call_accepting(instantiate(cfg.scheduler), opt, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0]) and lrs[3] == pytest.approx(0.5 * (1 + 0.5**0.5) / 1)
    step = make_config("scheduler=step", "scheduler.step_size=1").scheduler
    assert type(call_accepting(instantiate(step), opt, total_steps=6)) is torch.optim.lr_scheduler.StepLR
    assert make_config("scheduler=none").scheduler is None


def test_post_init_checks_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^grad_accum=0: must be >= 1"):
        make_config("grad_accum=0")
    with pytest.raises(ConfigError, match=r"^launcher.nnodes='0:2'"):
        make_config("launcher=torchrun", "launcher.nnodes=0:2")
    with pytest.raises(ConfigError, match=r"^objective_mode='maximize': must be one of auto, min, max$"):
        make_config("objective_mode=maximize")
    assert [make_config(*m).objective_mode for m in ([], ["objective_mode=min"])] == ["auto", "min"]


def test_ddp_buckets_default_to_pytorch_s_own() -> None:
    # null leaves DDP its 1 MiB first bucket (an explicit 25 MiB would make one bucket of a small net's gradients,
    # all-reduced only after the whole backward); a number is passed through
    assert make_config().ddp.bucket_cap_mb is None
    assert make_config("ddp.bucket_cap_mb=4").ddp.bucket_cap_mb == 4.0


def test_resolved_once_in_the_parent() -> None:
    cfg = make_config("seed=11")
    assert cfg.data["seed"] == 11  # ${seed} resolved before ranks see it
    assert OmegaConf.is_config(cfg.data) is False


BAD_INPUT = [
    (["model=nope"], "Could not find 'model/nope'. Available options in 'model': cnn, gpt, mlp, resnet101"),
    (["nosuchkey=1"], "nosuchkey: no such key"),
    # A typo is one line naming the key that exists; `+` adds arguments to model/data/task/optimizer/scheduler only.
    (["optimzer.lr=0.1"], "optimzer.lr: no such key (did you mean optimizer.lr?)"),
    (["+optimzer.lr=0.1"], "+optimzer.lr: no such key (did you mean optimizer.lr?); `+` adds arguments to model,"),
    (["+wandb.projct=x"], "+wandb.projct: no such key (did you mean wandb.project?)"),
    (["model.widht=3"], "Could not override 'model.widht'. To append to your config use +model.widht=3"),
    (["--shell-completion"], "--shell-completion needs what to do: ddpexp -sc install=bash"),
    (
        ["launcher._target_=ddpexp.launchers.nope.launch"],
        "launcher._target_='ddpexp.launchers.nope.launch': cannot import it (ModuleNotFoundError: No module named 'ddpexp.launchers.nope'); pick a launcher with launcher=NAME (env, ray, slurm, spawn, torchrun)",
    ),
    (["hparams_search=digits_optuna", "plan=true"], "plan=true with a search that picks each trial from the results"),
    (["epochs=abc"], "epochs=abc. Value 'abc' of type 'str' could not be converted to Integer"),
    (["gpus=0"], "gpus=0: must be >= 1"),
    (["batch_size=0"], "batch_size=0: must be >= 1"),
    (["precision=fp8"], "precision='fp8': must be one of auto, fp32, bf16, fp16"),
    (["launcher.bogus=1"], "launcher.bogus: no such key"),
    (["launcher=torchrun", "launcher.nnodes=2"], "launcher.nnodes=2: set launcher.rdzv_endpoint=HOST:PORT"),
    (["device=cuda"], "device=cuda: no CUDA GPU is visible here"),
    (["device=cuda", "gpus=4"], "device=cuda: no CUDA GPU is visible here"),
    (
        ["data=mnist", "data.root=empty"],
        "MNIST not found (missing MNIST/raw/train-images-idx3-ubyte); set data.download=true",
    ),
    (["data=cifar10", "data.root=empty", "data.download=true"], "could not download CIFAR10 to"),
    (["checkpoint_every_n_steps=0"], "checkpoint_every_n_steps=0: must be >= 1 or null"),
    (["resume=missing.pt"], "checkpoint missing.pt: no such file"),
    (["launcher=slurm", "launcher.signal=TERM"], "launcher.signal='TERM': must be a signal name without SIG"),
    (["ddp.bucket_cap_mb=0"], "ddp.bucket_cap_mb=0.0: must be > 0"),
    (["early_stop.patience=0"], "early_stop.patience=0: must be >= 1 (evaluations) or null (off)"),
    (["early_stop.patiense=2"], "early_stop.patiense: no such key (did you mean early_stop.patience?)"),
]


def test_config_drift_names_the_result_changing_keys_only() -> None:
    from ddpexp.parent.resume_decision import config_drift

    torchrun = "ddpexp.launchers.torchrun.launch"
    old = {"model": {"_target_": "m", "hidden": [256]}, "data": {"root": "/a", "seed": 0}, "batch_size": 64,
           "gpus": 2, "launcher": {"_target_": torchrun, "nnodes": "1"}, "epochs": 5, "wandb": {"mode": "offline"}}  # fmt: skip
    new = {**old, "data": {"root": "/b", "seed": 0}, "epochs": 9, "wandb": {"mode": "disabled"}}
    assert config_drift(old, new) == []  # dataset moved, trained longer, other tracking: the same run
    assert config_drift(old, {**new, "drop_last": False}) == []  # the key added later, at its default: as before
    assert config_drift(old, {**new, "drop_last": True}) == ["drop_last"]
    new = {**new, "model": {"_target_": "m", "hidden": [128]}, "gpus": 4, "seed": 1}
    assert config_drift(old, new) == ["model.hidden", "seed", "world_size"]
    elastic = {**old, "launcher": {"_target_": torchrun, "nnodes": "1:2"}}
    assert config_drift(old, elastic) == []  # elastic: the ranks check at start
    slurm = {**old, "launcher": {"_target_": "ddpexp.launchers.slurm.launch", "nodes": 1}}
    assert config_drift(slurm, {**slurm, "launcher": {**slurm["launcher"], "nodes": 2}}) == ["world_size"]
    assert config_drift(slurm, {**slurm, "launcher": {"_target_": "ddpexp.launchers.spawn.launch"}}) == []


@pytest.mark.parametrize(("args", "message"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_clear_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_ddpexp(*args, "hydra.run.dir=run", cwd=tmp_path, check=False, timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpexp: error: "), proc.stderr
    assert message in lines[0]
    assert not (tmp_path / "run").exists()  # no rank started, and no job dir left behind for nothing


@pytest.mark.parametrize("flag", ["--help", "--cfg=job"])
def test_help_and_cfg_do_not_import_torch(tmp_path: Path, flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpexp", flag],
        cwd=tmp_path, env=ddpexp_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and "torch" not in imported
    assert ("batch_size: 64" in proc.stdout) if flag == "--cfg=job" else ("== Config ==" in proc.stdout)
    if flag == "--help":  # ddpexp's own words, and the options one can pick (not the base_ schemas behind them)
        assert proc.stdout.startswith("ddpexp: PyTorch DistributedDataParallel experiments, configured with Hydra.")
        assert "launcher: env, ray, slurm, spawn, torchrun\n" in proc.stdout and "base_" not in proc.stdout
        assert "is powered by Hydra" not in proc.stdout and "ddpexp -sc install=bash" in proc.stdout


def test_a_model_that_raises_is_one_line_and_hydra_full_error_shows_why(tmp_path: Path) -> None:
    args = ["model=gpt", "hydra.run.dir=run"]  # gpt on images: its constructor lacks vocab_size, block_size
    line = "ddpexp: error: model=ddpexp.models.gpt(n_layer=2, n_head=4, n_embd=128, dropout=0.0, bias=True): TypeError"
    proc = run_ddpexp(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    full = run_ddpexp(*args, cwd=tmp_path, check=False, env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 2 and full.stderr.startswith("Traceback (most recent call last):"), full.stderr
    assert "TypeError: gpt() missing 2 required positional arguments" in full.stderr
    assert full.stderr.strip().splitlines()[-1].startswith(line)


def test_more_gpus_than_visible_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ddpexp.launchers.base import resolve_local

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # this machine has no GPU to count
    cfg = make_config("device=cuda", "gpus=4")
    with pytest.raises(ConfigError, match=r"^gpus=4: only 2 CUDA GPU\(s\) visible here; use gpus<=2$"):
        resolve_local(cfg)
    cfg = make_config("device=auto")
    resolve_local(cfg)
    assert (cfg.device, cfg.gpus) == ("cuda", 2)  # default: every visible GPU


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_plan_shows_every_rank_and_starts_nothing(tmp_path: Path, launcher: str) -> None:
    proc = run_ddpexp(f"launcher={launcher}", "gpus=3", "plan=true", "hydra.run.dir=job", cwd=tmp_path)
    assert f"ddpexp plan: launcher={launcher}, 3 rank(s); nothing was started" in proc.stdout
    for rank in range(3):
        assert f"rank {rank}: device=cpu RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=3" in proc.stdout
    assert f"job dir:   {tmp_path / 'job'}" in proc.stdout
    assert not (tmp_path / "job" / "logs").exists() and not (tmp_path / "job" / "summary.json").exists()


def test_more_cpu_ranks_than_cores_is_one_warning_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    proc = run_ddpexp("launcher=torchrun", f"gpus={cores + 1}", "plan=true", "hydra.run.dir=job", cwd=tmp_path)
    assert proc.stderr == (
        f"ddpexp: warning: gpus={cores + 1} CPU ranks on {cores} core(s) here: the ranks oversubscribe the cores; "
        f"gpus<={cores} gives each rank a core of its own\n"
    )
    assert f"{cores + 1} rank(s); nothing was started" in proc.stdout

    from ddpexp.launchers.base import resolve_local

    resolve_local(make_config("launcher=spawn", "device=cpu", f"gpus={cores}"))
    assert capsys.readouterr().err == ""


def test_slurm_without_sbatch_or_submitit_is_refused(tmp_path: Path) -> None:
    no_slurm = {"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    if subprocess.run(["which", "sbatch"], env=no_slurm, capture_output=True).returncode == 0:
        no_slurm["PATH"] = str(Path(sys.executable).parent)
    proc = run_ddpexp("launcher=slurm", "gpus=2", "hydra.run.dir=job", cwd=tmp_path, check=False, env=no_slurm)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "ddpexp: error: launcher=slurm: sbatch not found on PATH; run this on a Slurm login node"
    )
    shadow = tmp_path / "shadow" / "submitit"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('submitit is not installed')\n")
    proc = run_ddpexp("launcher=slurm", "gpus=2", "plan=true", "hydra.run.dir=job", cwd=tmp_path, check=False,
                      env={"PYTHONPATH": str(tmp_path / "shadow")})  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith(
        "ddpexp: error: launcher=slurm needs submitit: pip install submitit"
    )


def test_a_slurm_plan_without_sbatch_is_the_same_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """plan=true shows submitit's sbatch script, which submitit builds only where Slurm is ("Could not detect
    srun"): without sbatch on PATH a plan is refused as the run is."""
    from ddpexp.launchers import slurm

    monkeypatch.setenv("PATH", str(tmp_path))
    cfg = make_config("launcher=slurm", "device=cpu", "plan=true")
    with pytest.raises(ConfigError, match="^launcher=slurm: sbatch not found on PATH; run this on a Slurm login node$"):
        slurm.resolve(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.hiden=64", "model.hiden: no such key (did you mean model.hidden?); "
         "`+model.hiden=...` would add it as a new argument of model's _target_"),
        ("optimizer.lrr=0.1", "optimizer.lrr: no such key (did you mean optimizer.lr?); "
         "`+optimizer.lrr=...` would add it as a new argument of optimizer's _target_"),
        ("optimzer.lr=1", "optimzer.lr: no such key (did you mean optimizer.lr?)"),
    ],
)  # fmt: skip
def test_a_nested_typo_names_the_key_that_exists(override: str, message: str) -> None:
    """Hydra's advice for a key a group's YAML lacks is `+KEY=...` (hydra#1912), which adds the typo as an
    argument the _target_ then refuses: name the closest existing key instead."""
    from ddpexp.cli.errors import config_message

    with pytest.raises(Exception) as refused:
        make_config(override)
    assert config_message(refused.value) == message


def test_a_plan_shows_the_name_the_run_gets(tmp_path: Path) -> None:
    """plan=true is no part of the W&B name: the plan shows the one the real run gets."""
    from ddpexp.parent.launch import run_name

    assert run_name(["model=mlp", "plan=true", "optimizer.lr=0.1"], None) == "model=mlp,optimizer.lr=0.1"
    assert run_name(["plan=true"], None) == ""  # then the job dir's name, as a run with no overrides
    (tmp_path / "multirun.yaml").write_text("hydra: {overrides: {task: ['seed=1,2', plan=true]}}\n")
    assert run_name(["seed=1", "plan=true"], str(tmp_path)) == "seed=1"


def test_wandb_s_environment_fills_what_the_config_leaves_at_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """WANDB_MODE, WANDB_PROJECT, ... as W&B reads them, where wandb.* keeps its default (mode=auto); a value given
    on the command line (or a preset) wins."""
    from ddpexp.config import WandbConfig

    env = {"WANDB_MODE": "disabled", "WANDB_PROJECT": "mine", "WANDB_ENTITY": "team", "WANDB_RUN_GROUP": "g",
           "WANDB_NAME": "n", "WANDB_TAGS": "a, b", "WANDB_NOTES": "why", "WANDB_JOB_TYPE": "train"}  # fmt: skip
    got = WandbConfig().with_environment(env)
    assert got == WandbConfig(mode="disabled", project="mine", entity="team", group="g", name="n", tags=["a", "b"],
                              notes="why", job_type="train")  # fmt: skip
    given = WandbConfig(mode="offline", project="p", group="mygroup", tags=["x"])
    assert given.with_environment(env) == WandbConfig(mode="offline", project="p", entity="team", group="mygroup",
                                                      name="n", tags=["x"], notes="why", job_type="train")  # fmt: skip
    assert WandbConfig().with_environment({"WANDB_MODE": "dryrun"}).mode == "offline"  # W&B's older names
    assert WandbConfig().with_environment({"WANDB_DISABLED": "true"}).mode == "disabled"
    assert WandbConfig().with_environment({}) == WandbConfig()
    with pytest.raises(ConfigError, match="^WANDB_MODE='sometimes': must be one of online, offline, disabled"):
        WandbConfig().with_environment({"WANDB_MODE": "sometimes"})
    monkeypatch.setenv("WANDB_PROJECT", "mine")  # the parent reads the command's environment
    assert make_config().wandb.project == "mine" and make_config("wandb.project=p").wandb.project == "p"
