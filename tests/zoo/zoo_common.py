"""Shared data and loss for the zoo's model files (imported by them as a module beside the model file).

Every zoo model file imports this module by its bare name, as a user's model file imports its own code:
that import must work at run time too, from the output folder on every rank.
"""
import torch
import torch.nn.functional as F

SEQ, BATCH = 8, 4


def token_batch(step: int, vocab: int, seq: int = SEQ, batch: int = BATCH):
    """(ids, next-token targets) for step ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def causal_lm_batch(step: int, vocab: int):
    """``batch(step)`` of a Hugging Face causal LM: ids, no cache, next-token targets."""
    ids, target = token_batch(step, vocab)
    return (ids,), {"use_cache": False}, target


def causal_lm_loss(output, target):
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def examples_of(batch):
    """A model file's ``example_inputs``, ``example_kwargs`` and ``example_target``: the parts of ``batch(0)``."""
    return (lambda: batch(0)[0]), (lambda: batch(0)[1]), (lambda: batch(0)[2])
