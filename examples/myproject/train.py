"""The project's experiment from a script: `python train.py [OVERRIDE...]` runs what `ddpexp experiment=wine
[OVERRIDE...]` runs, here in the project folder, and prints the final metrics."""

import sys

import ddpexp

if __name__ == "__main__":  # spawned ranks import this file again: only the parent may start the run
    summary = ddpexp.run(["experiment=wine", *sys.argv[1:]])
    print(summary["final"], "->", summary.job_dir)
