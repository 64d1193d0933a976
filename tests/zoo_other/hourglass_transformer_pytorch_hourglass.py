"""lucidrains' Hourglass transformer (``hourglass_transformer_pytorch.HourglassTransformerLM``, pip
``hourglass-transformer-pytorch``; Nawrot et al., "Hierarchical Transformers Are More Efficient Language Models"),
its own classes unchanged, as its README's causal LM: token and learned absolute position embeddings, a pre-LayerNorm
causal block before the valley, the sequence shifted right by shorten_factor - 1 (``F.pad``) and mean-pooled by 2
(``NaiveDownsample``, einops ``reduce``), "attention resampling" (each pooled token attends, non-causally, to the 2
tokens of its bucket folded into the batch, ``b (n s) d -> (b n) s d``), a 2-layer causal valley transformer at half
the length, repeat-upsampling (``NaiveUpsample``) plus the residual, attention resampling back (each token attends
to its bucket's valley output), a causal block after the valley, a final LayerNorm and an untied head. Every
attention is ``to_q`` + fused ``to_kv``, ``einsum`` scores with a ``triu_`` causal mask; the feed-forward is GELU of
factor 4 (the library's default: ``HourglassTransformer`` does not pass ``ff_mult``). dim 64, depth (1, 2, 1),
shorten_factor 2, 4 heads of 16, max_seq_len 8, vocabulary 128.
"""
import torch
from hourglass_transformer_pytorch import HourglassTransformerLM
from other_common import HEAD_DIM, HEADS, HIDDEN, SEQ, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "hourglass-transformer-pytorch", version("hourglass-transformer-pytorch")
SOURCE = "hourglass_transformer_pytorch/hourglass_transformer_pytorch.py (HourglassTransformerLM, " \
         "HourglassTransformer, Transformer, Attention, NaiveDownsample, NaiveUpsample)"
HEADS_, KV_HEADS_ = HEADS, HEADS  # multi-head attention


def model():
    torch.manual_seed(0)
    return HourglassTransformerLM(num_tokens=VOCAB, dim=HIDDEN, max_seq_len=SEQ, depth=(1, 2, 1), shorten_factor=2,
                                  heads=HEADS, dim_head=HEAD_DIM, attn_resampling=True, updown_sample_type="naive",
                                  causal=True)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
