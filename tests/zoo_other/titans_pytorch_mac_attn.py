"""lucidrains' Titans, memory as context, without its neural memory (``titans_pytorch.MemoryAsContextTransformer``
with ``neural_memory_layers=()``, pip ``titans-pytorch``): the rest of the MAC transformer, its own classes unchanged,
trained as its README trains it, ``loss = transformer(seq, return_loss = True)`` on sequences one token longer than
the context (the model splits inputs and labels itself). (With its ``NeuralMemory``, ``titans_pytorch_mac.py``,
torch.export fails inside the memory's ``vmap(grad(functional_call))`` over ``TensorDict`` weights.) Layout: the
sequence cut into segments of 4 with 2 learned long-term memory tokens packed after each
(``pad_and_segment_with_inverse``, ``pack_with_inverse``), a continuous axial positional embedding (an MLP over the
positions), manifold-constrained hyper-connections (4 residual streams folded into the batch, each branch's stream mix
made doubly stochastic by 20 Sinkhorn-Knopp iterations, ``ManifoldConstrainedHyperConnections`` of pip ``hyper-
connections``), and per layer a ``SegmentedAttention`` (2 persistent memory tokens, rotary positions, value residual
from the first layer, attention within each segment and its memory tokens) and a GELU feed-forward; RMSNorm and an
untied head; dim 64, 4 heads of 16 (no grouped-query form), 2 layers, ff_mult 3 (a GEGLU of 128: int(dim * mult * 2 /
3)), vocabulary 128.
"""
from titans_pytorch_mac import (HEADS_, KV_HEADS_, LIBRARY, VERSION, batch, example_inputs,  # noqa: F401
                               example_kwargs, example_target, loss_fn, mac, optimizer)

SOURCE = "titans_pytorch/mac_transformer.py (MemoryAsContextTransformer, SegmentedAttention, FeedForward)"


def model():
    return mac(neural_memory_layers=())
