"""Moved to :mod:`tracepp.costs.measure_comm`; kept so that ``python -m tracepp.comm_bench`` works as before."""
from tracepp.costs.measure_comm import *  # noqa: F401,F403
from tracepp.costs.measure_comm import main

if __name__ == "__main__":
    main()
