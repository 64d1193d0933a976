"""Predict multi-GPU pipelines of Llama-7B from compute times measured on one GPU and an interconnect model.

    python -m benchmarks.gpu_predict [--seq 4096] [--microbatches 16] [--json out.json]

Measured on this GPU (bf16 autocast, one sample of ``--seq`` tokens per microbatch), with plain autograd in one
process, not through any pipeline runtime:

* one Llama-7B decoder layer (``benchmarks/llama_stage_model.py``'s layer): forward ``F``, full backward ``B``,
  input-gradient backward ``I`` (``torch.autograd.grad`` with ``inputs=`` the layer input) and weight-gradient
  backward ``W`` (``inputs=`` the parameters, after ``I``);
* the first stage's extra work: the token embedding (vocab 32000); the last stage's: final RMSNorm, the LM head
  and the cross-entropy loss in fp32.

A stage of ``k`` layers costs ``k`` times the layer (plus the embedding or head where it holds them). The
pipelines (4 and 8 GPUs; ``1f1b`` one stage per GPU, ``interleaved-1f1b``, ``zbv`` and ``dualpipev`` two per GPU)
are planned by tracepp's own planner and timed by its simulator with those costs and a communication model:
every boundary message (activation or gradient: ``seq * hidden * 2`` bytes in bf16) takes ``latency + bytes /
bandwidth``, added to the compute that produces it (defaults: NVLink 4 on H100 SXM, 450 GB/s per direction, 10 us; ``--bandwidth-gbs``,
``--latency-us``). The optimizer step is not included. These are predictions, not measurements of a multi-GPU
run (one GPU cannot host one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _timed(fn, device, rounds: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_layer(seq: int, device: torch.device, rounds: int) -> dict:
    """F, B, I, W of one decoder layer on one microbatch of ``seq`` tokens (seconds)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_stage_model", os.path.join(HERE, "llama_stage_model.py"))
    stage_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage_file)
    cfg = stage_file.config()
    cfg.num_hidden_layers = 1
    with torch.device(device):
        stage = stage_file.LlamaStage(cfg)
    params = [p for p in stage.parameters() if p.requires_grad]
    hidden = torch.randn(1, seq, cfg.hidden_size, device=device, requires_grad=True)
    grad_out = torch.randn(1, seq, cfg.hidden_size, device=device, dtype=torch.bfloat16)

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return stage(hidden)

    def full_backward():
        out = forward()
        torch.autograd.backward(out, grad_out)

    def input_then_weight(measure: str):
        out = forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (dx,) = torch.autograd.grad(out, hidden, grad_out, retain_graph=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        middle = time.perf_counter()
        torch.autograd.grad(out, params, grad_out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        return (middle - start) if measure == "I" else (end - middle)

    f = _timed(forward, device, rounds)
    fb = _timed(full_backward, device, rounds)
    i_times = [input_then_weight("I") for _ in range(rounds)]
    w_times = [input_then_weight("W") for _ in range(rounds)]
    return {"F": f, "B": max(fb - f, 0.0), "I": statistics.median(i_times), "W": statistics.median(w_times)}


def measure_ends(seq: int, device: torch.device, rounds: int, vocab: int = 32000, hidden_size: int = 4096) -> dict:
    """Extra F/B of the first stage (embedding) and of the last stage (norm, LM head, fp32 loss)."""
    embed = torch.nn.Embedding(vocab, hidden_size, device=device)
    norm = torch.nn.RMSNorm(hidden_size, device=device)
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device)
    tokens = torch.randint(0, vocab, (1, seq), device=device)
    hidden = torch.randn(1, seq, hidden_size, device=device, requires_grad=True)

    def embed_forward():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return embed(tokens)

    def embed_fb():
        embed_forward().float().sum().backward()

    def head_forward():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = head(norm(hidden))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), tokens.view(-1))

    def head_fb():
        head_forward().backward()

    ef, hf = _timed(embed_forward, device, rounds), _timed(head_forward, device, rounds)
    return {"embed": {"F": ef, "B": max(_timed(embed_fb, device, rounds) - ef, 0.0)},
            "head": {"F": hf, "B": max(_timed(head_fb, device, rounds) - hf, 0.0)}}


def stage_costs(layer: dict, ends: dict, num_stages: int, layers_total: int = 32) -> dict:
    """{(stage, kind): seconds} for ``num_stages`` stages of ``layers_total / num_stages`` layers each."""
    per_stage = layers_total // num_stages
    costs = {}
    for stage in range(num_stages):
        extra = {"F": 0.0, "B": 0.0}
        if stage == 0:
            extra = {kind: extra[kind] + ends["embed"][kind] for kind in extra}
        if stage == num_stages - 1:
            extra = {kind: extra[kind] + ends["head"][kind] for kind in extra}
        costs[(stage, "F")] = per_stage * layer["F"] + extra["F"]
        costs[(stage, "B")] = per_stage * layer["B"] + extra["B"]
        # the embedding's and head's backward are counted in I: their inputs' gradients are what the next
        # stage waits for, and their weight gradients are small next to the layers'
        costs[(stage, "I")] = per_stage * layer["I"] + extra["B"]
        costs[(stage, "W")] = per_stage * layer["W"]
    return costs


def predict(costs_for, num_gpus: int, microbatches: int, message_s: float) -> list:
    """Plan each schedule with tracepp's planner and time it with its simulator. The simulator's comm is free,
    so each message's time is added to the compute that produces it (F for an activation, B or I for a
    gradient): on the critical path, as on a link that carries one message at a time."""
    from tracepp.runtime.actions import Topology
    from tracepp.codegen.plan import build_plan
    from tracepp.codegen.simulate import simulate

    rows = []
    for schedule, per_gpu in (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2)):
        num_stages = num_gpus * per_gpu
        topology = Topology.chain(num_stages)
        plan = build_plan(schedule, num_gpus, num_stages, microbatches, topology, True)
        costs = dict(costs_for(num_stages))
        for (stage, kind), value in list(costs.items()):
            sends = (kind == "F" and stage < num_stages - 1) or (kind in ("B", "I") and stage > 0)
            if sends and plan.stage_to_rank[stage] != plan.stage_to_rank[stage + (1 if kind == "F" else -1)]:
                costs[(stage, kind)] = value + message_s
        sim = simulate(plan.actions, plan.stage_to_rank, topology, microbatches, costs=costs)
        compute = sum(costs_for(num_stages)[(stage, kind)] for stage in range(num_stages) for kind in ("F", "B"))
        rows.append({"gpus": num_gpus, "schedule": schedule, "stages": num_stages, "microbatches": microbatches,
                     "predicted_step_s": round(sim.makespan, 4), "bubble": round(sim.bubble_overall, 4),
                     "ideal_step_s": round(compute * microbatches / num_gpus, 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--bandwidth-gbs", type=float, default=450.0, help="per-direction link bandwidth, GB/s")
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = measure_layer(args.seq, device, args.rounds)
    ends = measure_ends(args.seq, device, args.rounds)
    message_bytes = args.seq * 4096 * 2
    message_s = args.latency_us * 1e-6 + message_bytes / (args.bandwidth_gbs * 1e9)
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "seq": args.seq, "microbatch_samples": 1,
              "measured_layer_s": layer, "measured_ends_s": ends,
              "interconnect": {"bandwidth_gbs": args.bandwidth_gbs, "latency_us": args.latency_us,
                               "message_bytes": message_bytes, "message_s": message_s},
              "predictions": []}
    print(json.dumps({"layer": layer, "ends": ends}), flush=True)
    for gpus in (4, 8):
        rows = predict(lambda stages: stage_costs(layer, ends, stages), gpus, args.microbatches, message_s)
        result["predictions"] += rows
        for row in rows:
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
