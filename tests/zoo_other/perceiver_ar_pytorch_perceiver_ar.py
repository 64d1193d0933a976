"""lucidrains' Perceiver AR (``perceiver_ar_pytorch.PerceiverAR``, pip ``perceiver-ar-pytorch``), its own classes
unchanged: the sequence is split into a prefix (the first ``cross_attn_seq_len`` positions) and the latest
positions; one ``CausalPrefixAttention`` layer lets the latest positions attend to the LayerNormed prefix and to
themselves (one shared ``to_kv`` applied to both, keys/values concatenated prefix-first, the heads processed in chunks
of ``max_heads_process`` by a Python loop over ``split``, a ``triu`` causal mask offset by the prefix length), then
``depth`` causal self-attention layers (fused ``to_qkv``, ``einsum`` attention) over the latest positions only, each
with a pre-LayerNorm GELU feed-forward; learned absolute positions plus rotary (the library's rotary width is
``max(32, dim_head // 2)``, wider than a head of 16, so heads are 32 wide here), an untied head. dim 64, 2 layers
(+1 perceive layer), 4 heads of 32, ff_mult 2, vocabulary 128, 8 tokens of which 4 are prefix: called as
``model(ids)`` it returns logits ``[batch, 4, vocab]`` for the last 4 positions, scored against their next tokens.
"""
import torch
from other_common import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, causal_lm_loss, sgd, token_batch, version
from perceiver_ar_pytorch import PerceiverAR

LIBRARY, VERSION = "perceiver-ar-pytorch", version("perceiver-ar-pytorch")
SOURCE = "perceiver_ar_pytorch/perceiver_ar_pytorch.py (PerceiverAR, CausalPrefixAttention, CausalAttention, " \
         "FeedForward, RotaryEmbedding)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention, no grouped-query form
PREFIX = SEQ // 2
DIM_HEAD = 32  # the library's rotary embedding is max(32, dim_head // 2) wide: a head narrower than 32 breaks it


def model():
    torch.manual_seed(0)
    return PerceiverAR(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, max_seq_len=SEQ, cross_attn_seq_len=PREFIX,
                       dim_head=DIM_HEAD, heads=HEADS, dropout=0.0, cross_attn_dropout=0.0, ff_mult=2,
                       perceive_depth=1, perceive_max_heads_process=2)


def batch(step: int):
    ids, target = token_batch(step)
    return (ids,), {}, target[:, PREFIX:].contiguous()  # logits come only for the positions after the prefix


example_inputs = lambda: batch(0)[0]  # noqa: E731
example_kwargs = lambda: batch(0)[1]  # noqa: E731
example_target = lambda: batch(0)[2]  # noqa: E731
loss_fn = causal_lm_loss
optimizer = sgd
