"""Shared data, loss and optimizer for the model files of ``tests/zoo_other`` (decoder code from libraries other
than transformers): imported by its bare name, as a user's model file imports its own code, so the same import
works on every rank from the output folder (the manifest records this folder).

Every model here is built at one tiny size, each setting shrunk by what it means (``docs/families.md``, second
table): hidden 64, 4 query heads of 16, 2 key/value heads where the architecture has grouped-query attention, 2
to 4 layers, a vocabulary of 128, every dropout off; a batch of 4 sequences of 8 tokens, SGD at lr 0.1.
"""
import importlib.metadata

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 128, 8, 4
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN = 64, 4, 2, 16, 2, 128


def token_batch(step: int, vocab: int = VOCAB, seq: int = SEQ, batch: int = BATCH):
    """(ids, next-token targets) for step ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as a data loader stacks them


def ids_batch(step: int):
    """``batch(step)`` of a model called as ``model(ids)``."""
    ids, target = token_batch(step)
    return (ids,), {}, target


def ids_targets_batch(step: int):
    """``batch(step)`` of a model called as ``model(ids, targets)`` that returns ``(logits, loss)`` (nanoGPT's,
    minGPT's): its own loss is trained (:func:`own_loss`)."""
    ids, target = token_batch(step)
    return (ids, target), {}, target


def shifted_batch(**kwargs):
    """``batch(step)`` of a model called with each sequence's L + 1 tokens that cuts them into its inputs and labels
    itself and returns its loss alone (``model(seq, return_loss=True)``: PaLM-rlhf's, titans'; train it with
    :func:`returned_loss`); ``kwargs``: more keyword arguments of the call."""
    def batch(step: int):
        ids, target = token_batch(step)
        seq = torch.cat([ids, target[:, -1:]], dim=1)  # the 9 tokens the loader gives: the model splits them itself
        return (seq,), {"return_loss": True, **kwargs}, target
    return batch


def returned_loss(output, target):
    """The loss of a model that returns its loss alone."""
    return output


def own_loss(output, target):
    """The loss a model returns beside its logits (``output[1]``: cross-entropy over every position, a mean)."""
    return output[1]


def causal_lm_loss(output, target):
    """Mean next-token cross-entropy of logits ``[batch, seq, vocab]`` (or a tuple/object holding them first)."""
    logits = output
    if isinstance(output, (tuple, list)):
        logits = output[0]
    elif hasattr(output, "logits"):
        logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def examples_of(batch):
    """A model file's ``example_inputs``, ``example_kwargs`` and ``example_target``: the parts of ``batch(0)``."""
    return (lambda: batch(0)[0]), (lambda: batch(0)[1]), (lambda: batch(0)[2])


def hf_llama():
    """A tiny Hugging Face ``LlamaForCausalLM`` at these dims (``use_cache=False``): the base the PEFT files adapt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, max_position_embeddings=64, use_cache=False))


def version(distribution: str) -> str:
    """The installed version of a pip distribution, or "vendored" where the code lives in this folder."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "vendored"


def provide_timm_drop_path() -> None:
    """torchscale imports timm for ``drop_path`` alone (``torchscale/component/droppath.py``), used only when
    ``drop_path_rate > 0``; timm 0.6.13 (torchscale's pin) imports torchvision, whose wheels here are CUDA builds that
    do not import on CPU torch. Where timm does not import, its ``drop_path`` (as written in timm 0.6.13) is provided
    under its module's name, before torchscale is imported."""
    import sys
    import types

    try:
        import timm.models.layers  # noqa: F401
        return
    except ImportError:
        pass

    def drop_path(x, drop_prob: float = 0., training: bool = False, scale_by_keep: bool = True):
        if drop_prob == 0. or not training:
            return x
        keep_prob = 1 - drop_prob
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
        if keep_prob > 0.0 and scale_by_keep:
            random_tensor.div_(keep_prob)
        return x * random_tensor

    for name in ("timm", "timm.models", "timm.models.layers"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["timm.models.layers"].drop_path = drop_path


class CausalAttention(torch.nn.Module):
    """Pre-norm causal self-attention over ``dim`` features in ``heads`` heads, written with torch alone: the block
    the files whose library gives only a wrapper (a reversible sequence, a checkpoint) put inside it."""

    def __init__(self, dim: int, heads: int = HEADS):
        super().__init__()
        self.heads, self.norm = heads, torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class FeedForward(torch.nn.Module):
    """Pre-norm GELU feed-forward over ``dim`` features (4x wide), beside :class:`CausalAttention`."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        return self.net(x)


class WrappedLM(torch.nn.Module):
    """An embedding, the layers ``make_layers()`` builds (a library's reversible sequence or checkpoint wrapper around
    :class:`CausalAttention` and :class:`FeedForward`), a final LayerNorm and a head: made in that order."""

    def __init__(self, make_layers):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = make_layers()
        self.norm, self.head = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        return self.head(self.norm(self.layers(self.embed(ids))))


def wrapped_lm(make_layers):
    """``model()``: a seeded :class:`WrappedLM` around ``make_layers()``."""
    def model():
        torch.manual_seed(0)
        return WrappedLM(make_layers)
    return model
