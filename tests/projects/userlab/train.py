"""`python train.py [OVERRIDE...]`: the project's experiment from Python."""

import json
import sys

import ddpexp

if __name__ == "__main__":
    summary = ddpexp.run(["experiment=charlm", *sys.argv[1:]])
    print(json.dumps({"job_dir": summary.job_dir, "final": summary["final"]}))
