"""llama2.c's Llama (github.com/karpathy/llama2.c ``model.py``, vendored unchanged in ``karpathy_llama2c/``: not on
PyPI), trained as its ``train.py`` trains it: ``model(X, Y)`` computes the logits of every position (with no
targets it computes only the last position's) and keeps the loss in ``model.last_loss``; the model file's loss is
that same cross-entropy (ignore_index -1) on the logits. Llama layout: RMSNorm computed in fp32 and cast back with
``type_as``, rotary positions as real cos/sin tables sliced to the sequence, ``repeat_kv``'s expand and reshape,
``F.scaled_dot_product_attention`` with ``is_causal``, a SwiGLU MLP, a head tied to the token embedding; 4 query
heads of 16, 2 key/value heads, 2 layers, vocabulary 128, dropout 0.
"""
import torch
import torch.nn.functional as F
from karpathy_llama2c.model import ModelArgs, Transformer
from other_common import HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, examples_of, sgd, token_batch

LIBRARY, VERSION = "llama2.c", "350e04f (vendored)"
SOURCE = "karpathy/llama2.c model.py (Transformer, TransformerBlock, Attention, FeedForward, RMSNorm)"
HEADS_, KV_HEADS_ = HEADS, KV_HEADS


def model():
    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
                                 multiple_of=32, max_seq_len=SEQ * 8, dropout=0.0))


def batch(step):
    ids, target = token_batch(step)
    return (ids, target), {}, target


example_inputs, example_kwargs, example_target = examples_of(batch)


def loss_fn(logits, target):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-1)


optimizer = sgd
