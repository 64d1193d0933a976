"""A tied-embedding LM for the long-job tests (tests/test_e2e_jobs.py), trained with AdamW on token files, with
hooks that misbehave on request: environment variables name a step and a rank.

- ``JOB_KILL_AT=S JOB_RANK=R``: rank R kills itself (SIGKILL) before step S, on torchrun's first attempt only.
- ``JOB_SIGNAL_AT=S JOB_RANK=R JOB_SIGNAL=USR1|TERM JOB_SIGNAL_TO=self|torchrun``: before step S, rank R sends
  the signal to itself or to its parent (torchrun); after a signal to torchrun, each later step takes 0.5 s longer
  (a real step's length: torchrun forwards the signal asynchronously, within one).
- ``JOB_FSIZE_AT=S JOB_RANK=R JOB_FSIZE=BYTES``: from step S on, rank R may not write a file larger than BYTES
  (RLIMIT_FSIZE: a full disk as the kernel reports it to that process, EFBIG).
"""
import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, LAYERS, BATCH, SEQ = 48, 16, 4, 4, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def model():
    torch.manual_seed(0)
    return TiedLM()


def example_inputs():
    return (torch.zeros(BATCH, SEQ, dtype=torch.long),)


def example_target():
    return torch.zeros(BATCH, SEQ, dtype=torch.long)


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


_SLOW = {"after_signal": False}


def _at(name, step):
    return os.environ.get(name) == str(step) and os.environ.get("JOB_RANK") == os.environ.get("RANK")


def _misbehave(pipe, step):
    if _at("JOB_KILL_AT", step) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    if _SLOW["after_signal"]:  # steps of a real size: torchrun's forwarded signal arrives within a step
        time.sleep(0.5)
    if _at("JOB_SIGNAL_AT", step):
        to_torchrun = os.environ.get("JOB_SIGNAL_TO") == "torchrun"
        os.kill(os.getppid() if to_torchrun else os.getpid(), getattr(signal, "SIG" + os.environ.get("JOB_SIGNAL", "USR1")))
        _SLOW["after_signal"] = to_torchrun
    if _at("JOB_FSIZE_AT", step):
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead of killing the process
        limit = int(os.environ["JOB_FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


try:  # in a rank process; absent when the tests import this file for eager training
    from tracepp_runtime import register_step_hook
except ImportError:
    pass
else:
    register_step_hook(_misbehave)
