"""Google DeepMind's RecurrentGemma / Griffin (``recurrentgemma.torch.Griffin``, pip ``recurrentgemma``), its own
PyTorch classes unchanged, at the tiny size: the Griffin pattern of two residual blocks with a recurrent temporal
block (``RecurrentBlock``: a GeLU-gated branch, a causal ``Conv1D`` written as a loop of shifted windows, the RG-LRU
with block-diagonal input/a gates, a ``torch.autograd.Function`` square root with a clipped gradient and a
sequential ``rnn_scan`` that writes ``y[:, t]`` in place) then one with local sliding-window multi-query attention
(``LocalAttentionBlock``: 4 query heads of 16, one key/value head, rotary on half of each head, window 4 of the 8
tokens, masks built from ``segment_pos``), gated GeLU MLPs of 128, RMSNorm with a ``1 + scale``, embeddings scaled by
sqrt(width) and tied to the head, a tanh logit soft cap of 30; width 64, 3 layers, vocabulary 128.
``gradient_checkpointing=False`` (Griffin's constructor argument; its default wraps every block in
``torch.utils.checkpoint``), and ``return_cache=False`` in the call (training: no cache to return).

pip ``recurrentgemma``'s top-level ``__init__`` imports its JAX implementation (flax, jax), which its ``torch`` extra
does not install; its torch subpackage imports nothing of it. So the package is entered here under its own name
without running that ``__init__`` (a module whose ``__path__`` is the installed package's folder), and
``recurrentgemma.torch`` is imported as installed.
"""
import importlib.util
import os
import sys
import types

import torch
from other_common import BATCH, HEADS, HIDDEN, SEQ, causal_lm_loss, examples_of, sgd, token_batch, version


def _enter_package_without_jax():
    if "recurrentgemma" in sys.modules:
        return
    spec = importlib.util.find_spec("recurrentgemma")
    package = types.ModuleType("recurrentgemma")
    package.__path__ = [os.path.dirname(spec.origin)]
    package.__file__ = spec.origin
    sys.modules["recurrentgemma"] = package


_enter_package_without_jax()
from recurrentgemma import common  # noqa: E402
from recurrentgemma.torch.griffin import Griffin  # noqa: E402

LIBRARY, VERSION = "recurrentgemma", version("recurrentgemma")
SOURCE = "recurrentgemma/torch/{griffin,modules,layers}.py"
HEADS_, KV_HEADS_ = HEADS, 1  # multi-query attention: one key/value head


def model():
    torch.manual_seed(0)
    R, A = common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION
    config = common.GriffinConfig(
        vocab_size=128, width=HIDDEN, mlp_expanded_width=128, num_heads=HEADS, block_types=(R, R, A),
        embeddings_scale_by_sqrt_dim=True, attention_window_size=4, logits_soft_cap=30.0, lru_width=HIDDEN)
    return Griffin(config, gradient_checkpointing=False)


def batch(step):
    ids, target = token_batch(step)
    segment_pos = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    return (ids, segment_pos), {"return_cache": False}, target


example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
