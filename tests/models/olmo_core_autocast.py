"""A decoder as OLMo-core writes OLMo 2 (``lib_style``: its RMSNorm computed under ``torch.autocast(enabled=False)``,
its rotary embedding applied under ``autocast(enabled=False)`` with the sin/cos table computed under another one
inside it, the reordered-norm block, q/k norms over all heads); 2 layers, hidden 64, 16 tokens.

Export wraps each such block in a ``wrap_with_autocast`` region, the table's inside the rotary one's; tracepp inlines
them all, the innermost first, and the split trains equal to eager.
"""
import torch
from lib_style import OLMoTransformer, loss_fn, sgd, token_batch


def model():
    torch.manual_seed(0)
    return OLMoTransformer(2)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
