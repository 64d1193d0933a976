"""A Llama 3 as torchtitan writes it with its default fused qkv (``lib_style``: ``TitanFusedQKVLinear`` holds one
``wqkv`` parameter and saves and loads its checkpoints as ``wq``, ``wk``, ``wv`` through state_dict hooks); 2 layers,
hidden 64, 4 query heads over 2 key/value heads, 16 tokens.

``model().state_dict()`` names ``layers.N.attention.qkv_linear.wq.weight`` (a new tensor the hook cut from
``wqkv``), not the ``wqkv.weight`` the module holds and the graph reads. The pipeline trains ``wqkv`` and ``--save``
writes the model's own layout, loadable with ``model().load_state_dict``.
"""
import torch
from lib_style import TitanDecoder, loss_fn, sgd, token_batch


def model():
    torch.manual_seed(0)
    return TitanDecoder(2)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
