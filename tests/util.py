"""Shared test helpers: split a model file, run it under torchrun (with a timeout), train eagerly to compare."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta

import torch

from tracepp.modelfile import load_model_file

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "models")
REPO = os.path.dirname(HERE)
TORCHRUN_TIMEOUT_S = 150  # a deadlock fails the test instead of eating CI's time
PEER_TIMEOUT_S = 45  # the runtime's own communication timeout inside the job


def model_path(name: str) -> str:
    return os.path.join(MODELS, name if name.endswith(".py") else name + ".py")


def torchrun(out_dir: str, nproc: int, *args: str, timeout: float = TORCHRUN_TIMEOUT_S, env_extra=None,
             real: bool = False):
    """Run ``out_dir/run.py args`` on ``nproc`` ranks as ``torchrun --standalone --nproc-per-node nproc`` does;
    returns a CompletedProcess (the ranks' stdout and stderr, exit code 0 or 1 as torchrun's).

    By default the ranks are started from this process (``start_ranks``), which saves torchrun's agent: a process
    that imports torch and rendezvouses before any rank starts, about 1.7 s of a 2-core machine per run and a
    third of a small test. ``real=True``, or ``TRACEPP_TEST_TORCHRUN=1`` for the whole suite, runs torchrun itself.
    Tests of torchrun's own part (--max-restarts, a signal to the agent, the README's commands) always do."""
    # one compile worker per rank: inductor's default pool (a process per core, each importing torch) only
    # competes with the other ranks on a 2-core machine (the compile tests 8 - 14 % faster, measured)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    env.update(env_extra or {})
    script = [os.path.join(out_dir, "run.py"), "--timeout", str(PEER_TIMEOUT_S), *args]
    if real or os.environ.get("TRACEPP_TEST_TORCHRUN") == "1":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   *script]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return start_ranks(script, nproc, env, timeout)


def start_ranks(script: list, nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """torchrun's part for one single-node attempt, without its agent process: this process hosts the store the
    ranks rendezvous through (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun, where the runtime's failure
    channel meets it too), starts ``nproc`` ranks with torchrun's environment, and when one exits non-zero stops
    the rest (SIGTERM, then SIGKILL after 30 s) as torchrun does. Their output goes to one stdout and one stderr,
    interleaved, as under torchrun."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=timeout))
    common = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                  LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                  ROLE_NAME="default", TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
                  TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    command = [sys.executable, *script]
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        ranks = [subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True,
                                  env=dict(common, RANK=str(r), LOCAL_RANK=str(r), ROLE_RANK=str(r)))
                 for r in range(nproc)]
        try:
            while any(rank.poll() is None for rank in ranks):
                if any(rank.returncode not in (None, 0) for rank in ranks):
                    _stop(ranks, signal.SIGTERM, grace_s=30)
                    break
                if time.monotonic() > deadline:
                    _stop(ranks, signal.SIGKILL, grace_s=5)
                    out.seek(0), err.seek(0)
                    raise subprocess.TimeoutExpired(command, timeout, output=out.read(), stderr=err.read())
                time.sleep(0.05)
        finally:
            _stop(ranks, signal.SIGKILL, grace_s=5)
            del store
        out.seek(0), err.seek(0)
        failed = any(rank.returncode != 0 for rank in ranks)
        return subprocess.CompletedProcess(command, 1 if failed else 0, out.read(), err.read())


def _stop(ranks: list, sig, grace_s: float) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(sig)
    end = time.monotonic() + grace_s
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < end:
        time.sleep(0.05)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def run_ok(out_dir: str, nproc: int, *args: str):
    result = torchrun(out_dir, nproc, *args)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}"
    return result


def eager_train(path: str, steps: int, lr: float = 0.01, initial=None) -> dict:
    """Train the unsplit model on the same batches the pipeline sees (from the state_dict ``initial`` if
    given); return its state_dict."""
    model_file = load_model_file(path)
    module = model_file.module
    model = model_file.model()
    if initial is not None:
        model.load_state_dict(initial)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = module.optimizer(params) if hasattr(module, "optimizer") else torch.optim.SGD(params, lr=lr)
    for step in range(steps):
        if hasattr(module, "batch"):
            args, kwargs, target = module.batch(step)
        else:
            args, kwargs, target = model_file.example_inputs(), model_file.example_kwargs(), module.example_target()
        loss = module.loss_fn(model(*args, **kwargs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def eager_mixed_precision(path: str, steps: int, num_microbatches: int, dp: int = 1, dtype=torch.bfloat16,
                          lr: float = 0.01, clip=None, optimizer: str = "model", initial=None,
                          separate_tied: bool = True, convert=None):
    """Eager training of the unsplit model under ``--mixed-precision params``' recipe, written out here (tracepp's
    runtime is not used): FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`` as
    ``fully_shard``/``replicate`` train with gradient accumulation (``test_precision.py`` holds this function equal
    to FSDP2 itself on one process).

    Each step: one copy of the parameters in ``dtype`` (buffers as they are), detached leaves; the global batch cut
    into ``dp`` contiguous replica slices, each into ``num_microbatches`` contiguous microbatches; per microbatch a
    forward of the copy (``torch.func.functional_call``) with floating inputs cast to ``dtype``, the loss in fp32 on
    the fp32-cast outputs times the microbatch's share of its replica's batch, a backward, and the copy's gradients
    added into the replica's fp32 sum; the replicas' sums added in replica order and divided by ``dp``; optionally
    ``clip_grad_norm_``; the optimizer (``model``: the model file's ``optimizer(...)`` and ``lr_scheduler(...)``,
    else SGD at ``lr``; ``sgd``) steps the fp32 masters. ``separate_tied``: each name of a tied weight (an embedding and a head) computes
    with a copy of its own, their gradients summed in fp32, as a pipeline does whose stages hold the two uses (each
    stage's engine casts its own copy; Megatron all-reduces the two main gradients); False: one copy, whose
    gradient autograd sums in ``dtype``, as FSDP2 on the whole model. ``convert(model)``: applied once the model is
    built (torchao's ``convert_to_float8_training`` for fp8's recipe). Returns (state_dict, [global-batch loss per
    step]). Runs on one thread, as the test ranks do (``OMP_NUM_THREADS=1``): a CPU kernel's reduction over several
    threads (layer norm's weight gradient) sums in another order, which bf16 then rounds differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _eager_mixed_precision(path, steps, num_microbatches, dp, dtype, lr, clip, optimizer, initial,
                                      separate_tied, convert)
    finally:
        torch.set_num_threads(threads)


def _eager_mixed_precision(path, steps, num_microbatches, dp, dtype, lr, clip, optimizer, initial, separate_tied,
                           convert=None):
    import torch.utils._pytree as pytree
    from torch.func import functional_call

    model_file = load_model_file(path)
    module = model_file.module
    model = model_file.model()
    if initial is not None:
        model.load_state_dict(initial)
    if convert is not None:  # e.g. torchao's convert_to_float8_training (--precision fp8's recipe)
        convert(model)
    params = [p for p in model.parameters() if p.requires_grad]
    # (name, master) of every copy a step makes: one per tied name with separate_tied, else one per parameter
    named = [(name, p) for name, p in model.named_parameters(remove_duplicate=not separate_tied) if p.requires_grad]
    from tracepp.runtime.optim import build_optimizer, build_scheduler

    hooks = module if optimizer == "model" else None  # the model file's optimizer(...) and lr_scheduler(...)
    opt = build_optimizer(hooks, list(model.named_parameters()), name="sgd", lr=lr)
    scheduler = build_scheduler(hooks, opt)

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    losses = []
    for step in range(steps):
        if hasattr(module, "batch"):
            args, kwargs, target = module.batch(step)
        else:
            args, kwargs, target = model_file.example_inputs(), model_file.example_kwargs(), module.example_target()
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        size = next(leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim())
        with torch.no_grad():
            copies = {name: p.detach().to(dtype).requires_grad_(True) for name, p in named}
        replica_sums, total = [], 0.0
        for replica in range(dp):
            per = size // dp
            sums = [None] * len(named)
            mb_size = per // num_microbatches
            for mb in range(num_microbatches):
                begin = replica * per + mb * mb_size

                def piece(value):
                    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == size:
                        return value[begin:begin + mb_size]
                    return value
                mb_args, mb_kwargs = pytree.tree_unflatten([cast(piece(leaf)) for leaf in leaves], spec)
                output = functional_call(model, copies, tuple(mb_args), dict(mb_kwargs),
                                         tie_weights=not separate_tied)
                output = pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t,
                                              output)
                loss = module.loss_fn(output, pytree.tree_map(piece, target)).float() * (mb_size / per)
                loss.backward()
                total += float(loss.detach()) / dp
                with torch.no_grad():
                    for k, (name, _p) in enumerate(named):
                        grad = copies[name].grad
                        copies[name].grad = None
                        if grad is not None:
                            sums[k] = grad.float() if sums[k] is None else sums[k].add_(grad)
            replica_sums.append(sums)
        with torch.no_grad():
            for k, (_name, param) in enumerate(named):
                found = [sums[k] for sums in replica_sums if sums[k] is not None]
                if found:
                    grad = found[0]
                    for other in found[1:]:
                        grad = grad + other
                    grad = grad / dp if dp > 1 else grad
                    param.grad = grad if param.grad is None else param.grad + grad  # a tied weight's names
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def max_state_diff(actual: dict, expected: dict) -> float:
    return max((actual[k].float() - expected[k].float()).abs().max().item() for k in expected)


def assert_state_close(actual: dict, expected: dict, atol: float = 2e-5) -> None:
    assert sorted(actual) == sorted(expected), f"keys differ: {sorted(set(actual) ^ set(expected))}"
    worst = {k: (actual[k].float() - expected[k].float()).abs().max().item() for k in expected}
    bad = {k: v for k, v in worst.items() if v > atol}
    assert not bad, f"parameters differ from eager training beyond {atol}: {bad}"


def initial_state(path: str) -> dict:
    return {k: v.detach().clone() for k, v in load_model_file(path).model().state_dict().items()}


def assert_trained(actual: dict, path: str) -> None:
    """Guard against a vacuous comparison: training must have moved the parameters."""
    initial = initial_state(path)
    moved = max((actual[k].float() - initial[k].float()).abs().max().item() for k in initial)
    assert moved > 1e-4, "parameters did not change: the comparison would prove nothing"


# -- tier 2: the stage graphs run one after another in this process -------------------------------------------

def assert_trains_like_eager(path: str, out: str, nproc: int, tmp_path, steps: int = 3) -> None:
    """``out`` (split from ``path``) trained ``steps`` steps on ``nproc`` ranks, its saved parameters moved and equal
    to eager training's on the same batches."""
    ckpt = str(tmp_path / "trained.pt")
    result = torchrun(out, nproc, "--steps", str(steps), "--save", ckpt, "--quiet")
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout}\n{result.stderr[-6000:]}"
    saved = torch.load(ckpt)
    assert_trained(saved, path)
    assert_state_close(saved, eager_train(path, steps))


def trace_and_split(path: str, split_points=None, num_stages=None):
    """(model file, traced, PipelineGraph) for a model file traced as one microbatch (the whole example batch)."""
    from tracepp.split.partition import split
    from tracepp.trace import trace

    model_file = load_model_file(path)
    traced = trace(model_file, 1)
    graph = split(traced, split_points or model_file.split_points, num_stages)
    return model_file, traced, graph


def run_stages_sequentially(traced, graph, model, args, kwargs, target=None, loss_fn=None):
    """Run each stage's graph in order, the way the pipeline runtime does, and backward stage by stage.

    Each stage gets its own leaf copy of every state tensor it reads (a tied weight gets one copy per stage),
    taken from ``model`` by the FQN export recorded; its arguments are those copies, then its root-input leaves
    of ``(args, kwargs)``, then the values it receives, detached and made leaves as after a transfer (so the
    boundary metadata's ``requires_grad`` is exercised). Backward runs from the last stage to the first; a
    value read by several stages gets the sum of their gradients. Returns ``(output, loss, grads)`` where
    ``output`` has the structure the unsplit forward returns and ``grads`` maps each parameter FQN to the sum
    of its copies' gradients (what the runtime all-reduces for shared weights).
    """
    import torch.fx as fx
    import torch.utils._pytree as pytree

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    leaves, _spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    copies, received_inputs, produced = [], [], {}
    output = None
    for stage in graph.stages:
        state = {}
        for name in stage.state:
            ref = graph.state[name]
            source = traced.program.constants[ref.fqn] if ref.kind == "constant" else tensors[ref.fqn]
            copy = source.detach().clone()
            if ref.kind == "parameter" and source.requires_grad:
                copy.requires_grad_(True)
            state[name] = copy
        copies.append(state)
        inputs = []
        for producer, name in stage.received:
            meta = graph.values[name].meta
            value = produced[name]
            static = [(dim, size) for dim, size in enumerate(meta.shape) if isinstance(size, int)]
            assert value.dim() == len(meta.shape) and all(value.shape[d] == s for d, s in static), \
                f"{name}: shape {list(value.shape)} but the boundary metadata says {meta.shape}"
            assert str(value.dtype) == f"torch.{meta.dtype}", f"{name}: dtype {value.dtype} but metadata {meta.dtype}"
            inputs.append(value.detach().requires_grad_(meta.requires_grad))
        received_inputs.append(inputs)
        roots = [leaves[graph.root_inputs[name].leaf_index] for name in stage.root_inputs]
        module = fx.GraphModule(torch.nn.Module(), stage.graph)
        result = module(*[state[name] for name in stage.state], *roots, *inputs)
        if stage.index == graph.num_stages - 1:
            out_leaves = [result[i] if kind == "value" else value
                          for i, (kind, value) in enumerate(graph.output_leaves)]
            output = pytree.tree_unflatten(out_leaves, graph.out_spec)
        else:
            produced.update(zip(stage.outputs, result))
    loss = loss_fn(output, target) if loss_fn is not None else None
    if loss is not None:
        grad_sums: dict = {}  # value name -> sum of the gradients its consumers sent back
        for stage in reversed(graph.stages):
            if stage.index == graph.num_stages - 1:
                loss.backward()
            else:
                pairs = [(produced[name], grad_sums[name]) for name in stage.outputs
                         if grad_sums.get(name) is not None and produced[name].requires_grad]
                if pairs:
                    torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
            for (producer, name), value in zip(stage.received, received_inputs[stage.index]):
                if value.requires_grad:
                    grad = value.grad if value.grad is not None else torch.zeros_like(value)
                    grad_sums[name] = grad if name not in grad_sums else grad_sums[name] + grad
    grads: dict = {}
    for state in copies:
        for name, copy in state.items():
            if copy.grad is not None:
                fqn = graph.state[name].fqn
                grads[fqn] = copy.grad if fqn not in grads else grads[fqn] + copy.grad
    return output, loss, grads


class RecomputedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ``aten.rsqrt`` (RMSNorm's forward op; its backward formula does not call it) run inside autograd's
    backward: each one is a forward recomputed by activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.recomputed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.rsqrt.default and torch._C._current_graph_task_id() != -1:
            self.recomputed += 1
        return func(*args, **(kwargs or {}))
