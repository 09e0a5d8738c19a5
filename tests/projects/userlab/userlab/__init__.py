"""A character model of Python's own source: the project's data, model and task."""
