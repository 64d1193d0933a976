"""Meta's reference Llama 3 (``llama_models.llama3.model.Transformer``, pip ``llama-models``), its own classes
unchanged, at the tiny size: fairscale's model-parallel layers (``ColumnParallelLinear`` for wq/wk/wv, w1/w3 and the
untied head, ``RowParallelLinear`` for wo and w2, ``VocabParallelEmbedding``) at a model-parallel world of one,
grouped-query attention (4 query heads of 16, 2 key/value heads, ``repeat_kv``) written into its key/value cache
(``cache_k``/``cache_v``, plain tensor attributes, written in place at ``start_pos`` and read back), rotary as complex
``freqs_cis`` (``view_as_complex``), an additive causal mask, RMSNorm, a SwiGLU MLP of 128
(``ffn_dim_multiplier=0.75``, ``multiple_of=32``); dim 64, 2 layers, vocabulary 128, called with ``start_pos=0``.

``Transformer.forward`` is inference-only: it is decorated with ``@torch.inference_mode()`` (model.py:280), so its
output has no autograd history. This file calls it as the library has it; ``llama_models_llama3_train.py``
(``LLAMA_MODELS_FORWARD=train``) calls the same function without the decorator (``Transformer.forward.__wrapped__``,
bound to the instance), which is differentiable at ``start_pos=0``.

fairscale's layers ask for the model-parallel group at construction and in every forward
(``get_model_parallel_world_size``, ``get_model_parallel_rank``). ``model()`` provides a group of one: where no
default process group exists (the study's own process), a one-process gloo world and fairscale's
``initialize_model_parallel(1)``; inside tracepp's ranks (a default group of 2 or 4 already up), a group of this rank
alone (``new_group([rank], use_local_synchronization=True)``: only the member calls it) as fairscale's
``_MODEL_PARALLEL_GROUP``. fairscale leaves the weights uninitialised (``init_method=lambda x: x``: a checkpoint is
meant to fill them); ``model()`` fills every parameter from a seeded normal(0, 0.02), norms at 1.
"""
import os
import types

import fairscale.nn.model_parallel.initialize as fs_init
import torch
import torch.distributed as dist
from llama_models.llama3.args import ModelArgs
from llama_models.llama3.model import Transformer
from other_common import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, causal_lm_loss, examples_of, sgd, token_batch, version

LIBRARY, VERSION = "llama-models", version("llama-models")
SOURCE = "llama_models/llama3/model.py, fairscale/nn/model_parallel/{layers,mappings}.py"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS
TRAIN_FORWARD = os.environ.get("LLAMA_MODELS_FORWARD", "") == "train"


def _model_parallel_of_one():
    if fs_init._MODEL_PARALLEL_GROUP is not None:
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        fs_init.initialize_model_parallel(1)
    else:
        fs_init._MODEL_PARALLEL_GROUP = dist.new_group([dist.get_rank()], use_local_synchronization=True)


def model():
    _model_parallel_of_one()
    torch.manual_seed(0)
    args = ModelArgs(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
                     multiple_of=32, ffn_dim_multiplier=0.75, norm_eps=1e-5, rope_theta=500000.0,
                     max_batch_size=4, max_seq_len=8)
    net = Transformer(args)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if TRAIN_FORWARD:
        net.forward = types.MethodType(Transformer.forward.__wrapped__, net)
    return net


def batch(step):
    ids, target = token_batch(step)
    return (ids,), {"start_pos": 0}, target


example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
