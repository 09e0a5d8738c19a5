"""The ranks' side, in every rank's process: the worker around the one DDP train loop, evaluation, the process
group, checkpoints and resume, tracking (run record, W&B), speed settings and stop signals. Names no launcher."""
