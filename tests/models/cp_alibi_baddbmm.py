"""Issue 57: attention spelled as ``baddbmm`` with an ALiBi bias (``lib_style.AlibiBaddbmmAttention``, as BLOOM and
its descendants write it: heads merged with the batch, the bias a slope per head times the key position, a causal
mask, softmax, ``bmm``), LayerNorm, a GELU MLP; 2 layers, hidden 64, 4 heads, 16 tokens. The second layer's bias
is the paper's, per query and key (``relative``: the slope times ``key - query``).

``--cp 2`` must place this attention as it places ``q @ k.T``: the keys and values gathered over the sequence, the
bias (where it has query rows) and the mask built for this rank's query rows against every key.
"""
import torch
import torch.nn as nn
from lib_style import D, AlibiBaddbmmAttention, Decoder, LayerNormMLP, loss_fn, sgd, token_batch


def model():
    torch.manual_seed(0)
    layers = iter([False, True])
    return Decoder(2, lambda: nn.LayerNorm(D), lambda: AlibiBaddbmmAttention(relative=next(layers)), LayerNormMLP)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
