"""mambapy's Mamba (``mambapy.mamba``, pip ``mambapy``: a pure-PyTorch Mamba with a parallel scan), its own classes
unchanged, under the language model mambapy's ``lm.py`` builds (an embedding, ``Mamba``, ``RMSNorm``, an untied
head, its initialisation without muP): ``mambapy.lm`` itself does not import without ``mamba_ssm`` (its
``mamba2.py`` imports mamba_ssm's Triton kernels unconditionally), so its ``LM`` is written out here as it is there.
d_model 64, 2 layers, d_state 16, expand 2, conv 4, vocabulary 128. ``MAMBAPY_PSCAN=0`` (``mambapy_mamba_seq.py``)
trains with the sequential scan (``pscan=False``) instead of mambapy's default parallel scan, a
``torch.autograd.Function`` with a backward of its own (``pscan.PScan``).
"""
import math
import os

import torch
import torch.nn as nn
from mambapy.mamba import Mamba, MambaConfig, RMSNorm
from other_common import HIDDEN, LAYERS, VOCAB, causal_lm_loss, examples_of, ids_batch, sgd, version

LIBRARY, VERSION = "mambapy", version("mambapy")
SOURCE = "mambapy/mamba.py (Mamba, ResidualBlock, MambaBlock, RMSNorm), mambapy/pscan.py"
HEADS_, KV_HEADS_ = None, None  # no attention
PSCAN = os.environ.get("MAMBAPY_PSCAN", "1") == "1"


class LM(nn.Module):
    """mambapy.lm.LM, as written there (its muP branches left out: off by default)."""

    def __init__(self, model_config: MambaConfig, vocab_size: int):
        super().__init__()
        self.config = model_config
        self.embedding = nn.Embedding(vocab_size, self.config.d_model, padding_idx=0)
        self.mamba = Mamba(self.config)
        self.norm_f = RMSNorm(self.config.d_model, self.config.rms_norm_eps, self.config.mup)
        self.lm_head = nn.Linear(self.config.d_model, vocab_size, bias=False)
        # self.embedding.weight = self.lm_head.weight # weight-tying disabled (as in mambapy)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith('mixer.out_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=self.config.base_std / math.sqrt(2 * self.config.n_layers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=self.config.base_std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=self.config.base_std)

    def forward(self, tokens):
        x = self.embedding(tokens)
        x = self.mamba(x)
        x = self.norm_f(x)
        return self.lm_head(x)


def model():
    torch.manual_seed(0)
    return LM(MambaConfig(d_model=HIDDEN, n_layers=LAYERS, d_state=16, expand_factor=2, d_conv=4, pscan=PSCAN),
              VOCAB)


batch = ids_batch
example_inputs, example_kwargs, example_target = examples_of(batch)
loss_fn = causal_lm_loss
optimizer = sgd
