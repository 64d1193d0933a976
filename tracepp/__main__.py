"""`python -m tracepp ...` is the same as the `tracepp` command."""
import sys

from tracepp.cli import main

sys.exit(main())
