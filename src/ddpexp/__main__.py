"""`python -m ddpexp`: the same command as `ddpexp` (ddpexp.cli.main)."""

from ddpexp.cli.main import main

if __name__ == "__main__":
    main()
