"""KAN-GPT (pip ``kan_gpt``, ``kan_gpt/model.py``): minGPT with every linear a Kolmogorov-Arnold layer, its default
``EFFICIENT_KAN`` (``kan_gpt/efficient_kan/model.py``, ``KANLinear``): a linear of ``silu(x)`` by ``base_weight``
plus a linear of the inputs' cubic B-spline bases (``b_splines``: comparisons against a grid buffer, then the
Cox-de Boor recursion) flattened ``[n, in * 8]`` by ``spline_weight * spline_scaler[..., None]`` viewed ``[out, in *
8]``; each KAN called on ``x.view(-1, in)``. Trained as its ``train.py`` does: ``logits, loss = model(x, y)``. 4 heads
of 16, 2 layers, vocabulary 128, dropout 0; its MLP 4x the hidden size, as minGPT's.
"""
import torch
from other_common import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, examples_of, ids_targets_batch, own_loss, sgd, version

LIBRARY, VERSION = "kan_gpt", version("kan_gpt")
SOURCE = "kan_gpt/model.py (GPT, Block, CausalSelfAttention), kan_gpt/efficient_kan/model.py (KAN, KANLinear)"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    from kan_gpt.model import GPT

    torch.manual_seed(0)
    config = GPT.get_default_config()
    config.model_type = None
    config.n_layer, config.n_head, config.n_embd = LAYERS, HEADS, HIDDEN
    config.vocab_size, config.block_size = VOCAB, SEQ * 8
    config.embd_pdrop = config.resid_pdrop = config.attn_pdrop = 0.0
    config.kan_implementation = "EFFICIENT_KAN"
    return GPT(config)


batch = ids_targets_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = own_loss  # the model's own loss


optimizer = sgd
