"""`ddpexp report PATH...`: finished jobs as one table and two plots, read from their run records alone."""
