"""A user's project on ddpexp: its own model (nets.TinyNet) and data (data.wine), configured in ../conf."""
