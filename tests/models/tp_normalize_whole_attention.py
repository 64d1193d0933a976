"""``tp_normalize_rmsnorm`` with its attention kept whole (the model file's ``tp_plan`` replicates the queries'
projection and, since ``repeat`` tiles their pieces as segments, the keys' and values'), as tracepp planned
x-transformers before its einsum attention had a rule: ``to_out`` is column-wise and the residual stream is sharded
on its features from there, so the next norm's ``F.normalize`` meets a sharded value. ``--tp 2`` must train equal
to eager: the L2 norm over features is not a sum of the ranks' norms (torch's ``_NormPartial``, once read as a plain
sum).
"""
from tp_normalize_rmsnorm import batch, example_inputs, example_target, loss_fn, model, optimizer  # noqa: F401

tp_plan = {f"transformer.h.*.attn.to_{name}.weight": "replicate" for name in ("q", "k", "v")}
