"""torchtitan's Llama 3 with q, k and v as three projections (``fuse_qkv=False``: torchtitan's ``QKVLinear``, as its
``debugmodel_non_fused_qkv`` flavours build them); otherwise ``torchtitan_llama3.py``."""
import os

os.environ["TORCHTITAN_FUSE_QKV"] = "0"
from torchtitan_llama3 import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                               example_kwargs, example_target, loss_fn, model, optimizer)
