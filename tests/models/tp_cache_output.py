"""Issue 57: a model that returns each layer's keys beside its logits, as a fine-tune that keeps a cache does (PEFT's
prefix tuning on a Hugging Face Llama returns ``past_key_values``: every layer's keys and values, ``[b, kv_heads,
s, d]``, a ``DynamicCache`` in the output); lit-gpt's attention and SwiGLU otherwise, hidden 64, 4 query heads, 2
key/value heads, 2 layers, 16 tokens. The loss reads the logits alone.

At ``--ranks 2 --tp 2`` layer 0's keys are made on stage 0 sharded by heads, cross to stage 1 as the shard and are
gathered there into the model's output. The verification took the last stage's output by the value's name, sent
sharded by stage 0, and joined the ranks' whole copies again ("output ... differs in its shape"): the plan, right,
was refused.
"""
import functools

import torch
import torch.nn as nn
from lib_style import D, HEADS, HEAD_DIM, Block, Decoder, RMSNorm, SeparateAttention, SwiGLU, apply_rope, rope_cache, sgd, token_batch  # noqa: F401
from lib_style import loss_fn as logits_loss

KV_HEADS = 2


class KeysOutAttention(SeparateAttention):
    """The attention's output and its keys after rotary, ``[b, kv_heads, s, d]``."""

    def __init__(self):
        super().__init__(KV_HEADS, flash=True)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        keys = apply_rope(self.to_k(x).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
        out = self.heads(x, cos, sin).transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM)
        return self.to_out(out), keys


class KeysBlock(Block):
    def forward(self, x, cos, sin):
        out, keys = self.attn(self.norm_1(x), cos, sin)
        x = x + out
        return x + self.mlp(self.norm_2(x)), keys


class KeysDecoder(Decoder):
    def forward(self, idx):
        cos, sin = rope_cache(idx.shape[1])
        x = self.transformer.wte(idx)
        cache = []
        for block in self.transformer.h:
            x, keys = block(x, cos, sin)
            cache.append(keys)
        return self.lm_head(self.transformer.ln_f(x)), tuple(cache)


def model():
    torch.manual_seed(0)
    decoder = KeysDecoder(2, functools.partial(RMSNorm, D), KeysOutAttention, SwiGLU)
    decoder.transformer.h = nn.ModuleList(
        [KeysBlock(functools.partial(RMSNorm, D), KeysOutAttention, SwiGLU) for _ in range(2)])
    return decoder


def loss_fn(output, target):
    return logits_loss(output[0], target)


batch = token_batch


def example_inputs():
    return batch(0)[0]


def example_target():
    return batch(0)[2]


optimizer = sgd
