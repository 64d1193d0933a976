"""lucidrains' RingTransformer (pip ``ring-attention-pytorch``), its own classes unchanged, with
``force_regular_attn=True``: ``ring_attention_pytorch_ring.py``'s model whose layers run the library's
``default_attention`` (einsum scores, a ``torch.where`` causal mask, autograd's own backward) in place of its blockwise
``ring_flash_attn`` (an autograd ``Function`` whose forward runs under ``torch.no_grad``, refused at the split). Its
fused ``to_qkv`` is viewed as heads and split by head counts (4 query heads, 2 and 2 key/value heads), k and v tiled
to the query heads by einops' ``repeat('... h d -> ... (g h) d')``. Same sizes. Built by
``ring_attention_pytorch_ring.py`` with ``RING_REGULAR_ATTN=1``.
"""
import os

os.environ["RING_REGULAR_ATTN"] = "1"
from ring_attention_pytorch_ring import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                                         example_kwargs, example_target, loss_fn, model, optimizer)
