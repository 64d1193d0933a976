"""Point-to-point latency and bandwidth between neighbouring ranks (the simulator's communication calibration).

    torchrun --nproc-per-node R -m benchmarks.calibrate_comm [--json comm.json] [--sizes 4096,1048576,16777216]

The measurement lives in the package, ``tracepp.costs.measure_comm`` (``tracepp calibrate OUT`` launches it with
torchrun and writes the ``comm`` section of ``OUT/calibration.json``); this entry point is kept for the
benchmarks and runs the same code.
"""
from __future__ import annotations

from tracepp.costs.measure_comm import fit, main, ping_pong  # noqa: F401

if __name__ == "__main__":
    main()
