"""nanoGPT's GPT (github.com/karpathy/nanoGPT ``model.py``, vendored unchanged in ``karpathy_nanogpt/``: not on PyPI),
trained as nanoGPT's ``train.py`` trains it: ``logits, loss = model(X, Y)``, the loss computed inside the model (the
logits of every position only when targets are given). GPT-2 layout: learned positions, LayerNorm, one fused
``c_attn`` projection, GELU MLP, a head tied to the token embedding; 4 heads of 16 (multi-head: 4 key/value
heads), 2 layers, vocabulary 128, dropout 0, biases on.
"""
import torch
from karpathy_nanogpt.model import GPT, GPTConfig
from other_common import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, examples_of, ids_targets_batch, own_loss, sgd

LIBRARY, VERSION = "nanoGPT", "3adf61e (vendored)"
SOURCE = "karpathy/nanoGPT model.py (GPT, Block, CausalSelfAttention, MLP, LayerNorm)"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ * 8, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=HIDDEN,
                         dropout=0.0, bias=True))


batch = ids_targets_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = own_loss  # the model's own loss


optimizer = sgd
