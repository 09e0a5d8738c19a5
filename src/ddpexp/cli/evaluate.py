"""`ddpexp eval RUN_DIR [--checkpoint best|last|PATH] [--split val|test] [KEY=VALUE ...]` and, from Python,
`ddpexp.evaluate(...)` and `ddpexp.load_model(...)`: a finished (or stopped) run's checkpoint scored again, on its
own config, by the training's exact evaluation (parent/evaluate.py), or its model handed back for use."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

USAGE = "ddpexp eval RUN_DIR [--checkpoint best|last|PATH] [--split val|test] [KEY=VALUE ...]"


def main(argv: list[str]) -> int:
    """The command: one result line (and RUN_DIR/eval/NAME.json), or one error line and exit 2."""
    from ddpexp.cli.errors import report
    from ddpexp.parent.command import Command

    parser = _Parser(prog="ddpexp eval", usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's job dir (outputs/DATE/TIME, a sweep's job)")
    parser.add_argument("--checkpoint", default="best", help="best (default), last, or a checkpoint file's PATH")
    parser.add_argument("--split", default="val", help="val (default) or test")
    args, overrides = parser.parse_known_args(argv)  # KEY=VALUE overrides anywhere: gpus=3, device=cpu, ...
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    record = report(lambda: _evaluate(args.run_dir, args.checkpoint, args.split, overrides), Command(["eval", *argv]))
    metrics = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record["metrics"].items())
    print(
        f"ddpexp: eval of {args.checkpoint} (step {record['checkpoint_step']}) on {record['split']}, "
        f"{record['world_size']} rank(s): {metrics} scored={record['scored']} -> {record['path']}"
    )
    return 0


def evaluate(
    run_dir: str, checkpoint: str = "best", split: str = "val", overrides: Sequence[str] = (), gpus: int | None = None
) -> dict[str, float]:
    """The metrics of `checkpoint` (best, last or a PATH) of the run in `run_dir` on `split` (val, test), as
    `ddpexp eval` scores them (`{"test/acc": ..., ...}`); the record is written to RUN_DIR/eval/ as well. `gpus`
    is the same as the override `gpus=N`. Bad input raises ddpexp.ConfigError, a failed rank RankFailure."""
    extra = [f"gpus={gpus}"] if gpus is not None else []
    return dict(_evaluate(run_dir, checkpoint, split, [*overrides, *extra])["metrics"])


def load_model(run_dir: str, checkpoint: str = "best") -> Any:
    """The model of the run in `run_dir`, built from the run's config (a project's own `_target_` too) with the
    weights of `checkpoint` (best, last or a PATH; loaded with weights_only=True): a plain torch.nn.Module, not
    DDP-wrapped, on the CPU, in eval mode."""
    from ddpexp.parent import evaluate as parent

    with _project_of(run_dir):
        return parent.load_model(run_dir, checkpoint)


def _evaluate(run_dir: str, checkpoint: str, split: str, overrides: Sequence[str]) -> dict[str, Any]:
    from ddpexp.parent import evaluate as parent

    with _project_of(run_dir):
        return parent.evaluate(run_dir, checkpoint, split, overrides)


@contextmanager
def _project_of(run_dir: str) -> Iterator[None]:
    """The run's project folder importable (and inherited by the ranks), as while it trained."""
    from ddpexp.cli import project
    from ddpexp.parent.evaluate import project_conf

    with project.on_path(project_conf(run_dir)):
        yield


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line and exit 2, like every other bad input
        print(f"ddpexp: error: eval: {message} (usage: {USAGE})", file=sys.stderr)
        sys.exit(2)
