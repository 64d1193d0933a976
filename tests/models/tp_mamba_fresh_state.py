"""A Mamba mixer whose scan makes its state from ``A`` itself, as transformers 5.25's Falcon-Mamba does in its
fallback scan: ``A.new_zeros(batch, channels, state)`` (a new tensor of the sizes it names, ``A`` giving only its
dtype and device; Falcon-Mamba's is left unused beside the loop, this one starts it). Otherwise
``tp_selective_scan.py``'s mixer. Under ``--tp 2`` the channels shard (``in_proj`` column-wise, ``out_proj``
row-wise) and so do ``A_log``, ``D``, ``dt_proj`` and the conv: the state is read at this rank's channels. The walk
gathered ``A`` for ``new_zeros`` and kept ``A_log`` whole (Falcon-Mamba's share of each layer went from 0.998 to
0.937 with transformers 5.25).
"""
from tiny_lm import examples_of, lm_loss, model_of, token_batch
from tp_selective_scan import BATCH, D, INNER, SEQ, STATE, VOCAB
from tp_selective_scan import Mixer as ZerosMixer


class Mixer(ZerosMixer):
    def initial_state(self, a, batch: int):
        return a.new_zeros(batch, INNER, STATE)


model = model_of(VOCAB, D, Mixer)
batch = token_batch(VOCAB, BATCH, SEQ, 1501)
example_inputs, example_target = examples_of(batch)
loss_fn = lm_loss(VOCAB)
