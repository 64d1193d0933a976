"""mambapy's Mamba trained with its sequential selective scan (``MambaConfig(pscan=False)``: a Python loop over the
positions, ``selective_scan_seq``); otherwise ``mambapy_mamba.py``."""
import os

os.environ["MAMBAPY_PSCAN"] = "0"
from mambapy_mamba import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                           example_kwargs, example_target, loss_fn, model, optimizer)

SOURCE = SOURCE + " (selective_scan_seq)"
