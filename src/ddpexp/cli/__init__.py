"""The command: `ddpexp ...` and `ddpexp.run(...)`, one Command object each; Hydra glue (every patch to its
internals, each citing why), the project lookup, and how a command fails (one line and an exit code)."""
