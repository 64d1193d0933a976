"""torchtune's Qwen2 (``torchtune.models.qwen2.qwen2``, the component builder every Qwen2 size calls; pip
``torchtune`` 0.6.1), its own classes unchanged: ``TransformerDecoder``, ``MultiHeadAttention`` with biases on the
separate q/k/v projections (none on the output), grouped-query attention (2 key/value heads), rotary positions,
``FeedForward`` (SwiGLU), ``RMSNorm``, a head tied to the embedding (``TiedLinear``, as Qwen2-0.5B); dim 64, 4 query
heads, 2 layers, an MLP of 128, vocabulary 128. The model is built by ``torchtune_llama3.py`` with this builder name.
"""
import os

os.environ["TORCHTUNE_BUILDER"] = "qwen2"
from torchtune_llama3 import (HEADS_, KV_HEADS_, LIBRARY, SOURCE, VERSION, batch, example_inputs,  # noqa: E402,F401
                              example_kwargs, example_target, loss_fn, model, optimizer)
