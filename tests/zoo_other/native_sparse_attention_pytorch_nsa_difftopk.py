"""``native_sparse_attention_pytorch_nsa.py`` with ``NSA_DIFF_TOPK=1``: lucidrains' Native Sparse Attention decoder
(``Transformer`` with ``SparseAttention``) selecting its fine blocks with ``use_diff_topk=True`` (the selected keys
scaled by a straight-through gate of their importance) and ``query_heads_share_selected_kv=False`` (each query head
its own blocks; keys/values tiled per query head before the ``gather``). Everything else as that file.
"""
import os

os.environ["NSA_DIFF_TOPK"] = "1"

from native_sparse_attention_pytorch_nsa import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch,  # noqa: E402,F401
                                                 example_inputs, example_kwargs, example_target, loss_fn, model,
                                                 optimizer)
