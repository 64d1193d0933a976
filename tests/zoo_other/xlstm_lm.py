"""NX-AI's xLSTM (``xlstm.xLSTMLMModel`` built from ``xLSTMLMModelConfig``, pip ``xlstm``), its own classes
unchanged: the NeurIPS language model (an ``nn.Embedding``, ``xLSTMBlockStack`` of pre-LayerNorm residual blocks, a
post-blocks LayerNorm and an untied ``lm_head``), initialised by its own ``reset_parameters`` as the library's
training script does. Its mLSTM blocks (``mLSTMLayer``: an up-projection of factor 2, a causal depthwise conv of 4,
block-diagonal q/k/v projections ``LinearHeadwiseExpand`` of block size 4, and ``mLSTMCell`` in its pure-PyTorch
parallel form ``parallel_stabilized_simple`` with a head-wise GroupNorm) need no kernels: ``xlstm_large``, which
imports ``mlstm_kernels``, is not used. embedding dim 64, 4 heads, 2 blocks, context 64, vocabulary 128, every
dropout off; called as ``model(ids)``, it returns logits ``[batch, seq, vocab]``.

``XLSTM_SLSTM=1`` makes block 1 an sLSTM block (``sLSTMLayer`` with its ``vanilla`` backend, a Python loop over the
positions, and its gated feed-forward of factor 1.3) instead of an mLSTM block. torch.export cannot trace that
backend (``slstm.py:25``, ``if torch.all(n == 0.0):`` branches on a tensor's value), so it is not in the table.
"""
import os

import torch
from other_common import HEADS, HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version
from xlstm import (FeedForwardConfig, mLSTMBlockConfig, mLSTMLayerConfig, sLSTMBlockConfig, sLSTMLayerConfig,
                   xLSTMLMModel, xLSTMLMModelConfig)

LIBRARY, VERSION = "xlstm", version("xlstm")
SLSTM = os.environ.get("XLSTM_SLSTM", "0") == "1"
SOURCE = "xlstm/xlstm_lm_model.py (xLSTMLMModel), xlstm/xlstm_block_stack.py, xlstm/blocks/xlstm_block.py, " \
         "xlstm/blocks/mlstm/{layer,cell,backends}.py, xlstm/components/{conv,ln,linear_headwise}.py" + (
             ", xlstm/blocks/slstm/{layer,cell}.py, xlstm/blocks/slstm/src/vanilla, xlstm/components/feedforward.py"
             if SLSTM else "")
HEADS_, KV_HEADS_ = HEADS, HEADS  # mLSTM heads; no grouped-query form
CONTEXT = 64


def model():
    torch.manual_seed(0)
    config = xLSTMLMModelConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4,
                                                            num_heads=HEADS, proj_factor=2.0)),
        slstm_block=sLSTMBlockConfig(
            slstm=sLSTMLayerConfig(backend="vanilla", num_heads=HEADS, conv1d_kernel_size=4,
                                   bias_init="powerlaw_blockdependent"),
            feedforward=FeedForwardConfig(proj_factor=1.3, act_fn="gelu")) if SLSTM else None,
        slstm_at=[1] if SLSTM else [],
        context_length=CONTEXT, num_blocks=LAYERS, embedding_dim=HIDDEN, vocab_size=VOCAB,
        dropout=0.0, add_embedding_dropout=False, tie_weights=False, bias=False)
    lm = xLSTMLMModel(config)
    lm.reset_parameters()
    return lm


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
