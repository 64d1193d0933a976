"""Moved to :mod:`tracepp.costs.measure_stages`; kept so that ``python -m tracepp.stage_costs`` works as before."""
from tracepp.costs.measure_stages import *  # noqa: F401,F403
from tracepp.costs.measure_stages import main

if __name__ == "__main__":
    import sys

    sys.exit(main())
