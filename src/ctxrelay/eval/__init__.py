"""Evaluation harness: datasets, needle QA, metrics against a native reference, results files, plots.

Floor 4: imports models/, transports and relay/, never the other way round. Each transport's
calibration-data loading and benchmark glue lives here in `<transport>_jobs.py`.
"""


class EvalError(RuntimeError):
    """A clear, user-facing error from the evaluation harness (bad input, missing data package)."""
