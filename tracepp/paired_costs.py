"""Moved to :mod:`tracepp.costs.measure_in_run`; kept so that ``python -m tracepp.paired_costs`` works as before."""
from tracepp.costs.measure_in_run import *  # noqa: F401,F403
from tracepp.costs.measure_in_run import main

if __name__ == "__main__":
    main()
