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


def version(distribution: str) -> str:
    """The installed version of a pip distribution, or "vendored" where the code lives in this folder."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "vendored"
