"""minGPT's GPT (github.com/karpathy/minGPT ``mingpt/model.py``, vendored unchanged in ``mingpt/``: not on PyPI),
trained as minGPT's ``Trainer`` trains it: ``logits, loss = model(x, y)``. GPT-2 layout: learned positions,
LayerNorm, one fused ``c_attn`` projection, an explicit masked attention (a causal ``bias`` buffer, ``masked_fill``,
softmax), GELU written out (``NewGELU``), an untied head; 4 heads of 16, 2 layers, vocabulary 128, dropout 0.
"""
import torch
from mingpt.model import GPT
from other_common import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, examples_of, ids_targets_batch, own_loss, sgd

LIBRARY, VERSION = "minGPT", "37baab7 (vendored)"
SOURCE = "karpathy/minGPT mingpt/model.py (GPT, Block, CausalSelfAttention, NewGELU)"
HEADS_, KV_HEADS_ = HEADS, HEADS


def model():
    torch.manual_seed(0)
    config = GPT.get_default_config()
    config.model_type = None
    config.n_layer, config.n_head, config.n_embd = LAYERS, HEADS, HIDDEN
    config.vocab_size, config.block_size = VOCAB, SEQ * 8
    config.embd_pdrop = config.resid_pdrop = config.attn_pdrop = 0.0
    return GPT(config)


batch = ids_targets_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = own_loss  # the model's own loss


optimizer = sgd
