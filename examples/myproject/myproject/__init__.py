"""A user's project on ddpexp: its own model (nets.TinyNet), data (data.wine) and task (tasks.BalancedAccuracy),
configured in ../conf."""
