"""Export failures on known patterns say what to change, through the CLI, without a raw traceback."""
import re

import pytest

from tracepp.cli import main as cli_main
from util import model_path


def run_cli(capsys, *argv):
    code = cli_main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_hf_model_without_use_cache_false_names_the_fix(tmp_path, capsys):
    pytest.importorskip("transformers")
    source = open(model_path("hf_llama")).read()
    assert source.count('{"use_cache": False}') == 2
    path = tmp_path / "llama_with_cache.py"
    path.write_text(source.replace('{"use_cache": False}', "{}"))  # the HF default: use_cache=True
    code, text = run_cli(capsys, "split", str(path), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 2, text
    assert "DynamicCache" in text and "use_cache=False" in text and "example_kwargs()" in text, text
    assert "Traceback" not in text and "<string>" not in text, text
    assert not (tmp_path / "out" / "manifest.json").exists()


UNREGISTERED_OUTPUT = """
import torch
import torch.nn as nn


class Result:
    def __init__(self, value):
        self.value = value


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return Result(self.a(x))


def model():
    return Net()


def example_inputs():
    return (torch.randn(4, 4),)
"""


def test_output_class_that_is_not_a_pytree_names_the_fix(tmp_path, capsys):
    path = tmp_path / "custom_output.py"
    path.write_text(UNREGISTERED_OUTPUT)
    code, text = run_cli(capsys, "split", str(path), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 2, text
    assert "Result" in text and "output" in text and "register_dataclass" in text, text
    assert "use_cache" not in text and "Traceback" not in text, text


EXPERT_COUNTS = """
import torch
import torch.nn as nn


class SwitchCounts(nn.Module):  # labml's Switch Transformer: each expert's tokens by nonzero, counted with len()
    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(8, 2), nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        routes = self.router(x).argmax(-1)
        indexes = [torch.eq(routes, i).nonzero(as_tuple=True)[0] for i in range(2)]
        counts = x.new_tensor([len(indexes[i]) for i in range(2)])
        out = x.new_zeros(x.shape)
        for i in range(2):
            out[indexes[i], :] = self.experts[i](x[indexes[i], :])
        return out * counts.sum()


def model():
    return SwitchCounts()


def example_inputs():
    return (torch.randn(4, 8),)
"""


def test_a_size_made_from_values_is_not_taken_for_a_dynamic_dim(tmp_path, capsys):
    # export's "Could not extract specialized integer from data-dependent expression u0" was answered with the advice
    # for a declared dynamic dim ("narrow the dim's range"), which a file that declares none cannot follow
    path = tmp_path / "expert_counts.py"
    path.write_text(EXPERT_COUNTS)
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 2, text
    assert "data-dependent" in text and "len()" in text and "torch.bincount" in text, text
    assert "narrow the dim's range" not in text and "Traceback" not in text, text


def test_finding_a_frames_module_does_not_import_lazy_placeholders(monkeypatch, tmp_path):
    # SpeechBrain puts lazy placeholders in sys.modules (deprecated paths, optional integrations such as k2); finding
    # the module of a traced frame's file (to look for autograd.Functions in it) read every module's __file__ with
    # getattr, which imports a placeholder's target: a missing optional package stopped every split of a SpeechBrain
    # model with "ImportError: Lazy import of LazyModule(... k2_fsa ...) failed"
    import importlib.util
    import sys
    import types

    from tracepp import custom_functions

    class LazyModule(types.ModuleType):  # speechbrain/utils/importutils.py, its target not installed
        def __getattr__(self, name):
            raise ImportError(f"Lazy import of {self.__name__} failed")

    monkeypatch.setitem(sys.modules, "speechbrain_like.k2_fsa", LazyModule("speechbrain_like.k2_fsa"))
    path = tmp_path / "layers.py"
    path.write_text("WIDTH = 4\n")
    spec = importlib.util.spec_from_file_location("layers_after_placeholders", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "layers_after_placeholders", module)  # after the placeholder, as SpeechBrain's
    assert custom_functions._module_of(str(path)) is module
    assert custom_functions._function_forwards(str(path)) == []


def test_python_scalar_input_must_keep_its_traced_value(tmp_path):
    """export bakes a Python scalar kwarg (mask_kwargs' ``scale``) into the graph: a new value fails, never ignored."""
    import torch

    from tracepp.driver import split_model

    from tracepp.runtime.mesh import Layout
    from tracepp.modelfile import load_model_file
    from tracepp.runtime.batching import MicrobatchSplitter
    from tracepp.runtime.loading import load_spec
    from tracepp.runtime.failure import PipelineError

    path = model_path("mask_kwargs")
    manifest = split_model(path, str(tmp_path / "out"), schedule="gpipe", num_microbatches=2, layout=Layout(pp=2))
    scale = next(r for r in manifest["root_inputs"] if r["path"] == "kwargs['scale']")
    assert scale["constant"] == 0.5 and scale["dtype"] is None
    module = load_model_file(path).module
    checker = MicrobatchSplitter(manifest, load_spec(manifest, "in_spec"))
    args, kwargs, target = module.batch(1)
    checker.split(1, args, kwargs, target, torch.device("cpu"))  # the traced value passes
    with pytest.raises(PipelineError, match=r"kwargs\['scale'\] is 0\.7 but the pipeline was traced with 0\.5"):
        checker.split(1, args, dict(kwargs, scale=0.7), target, torch.device("cpu"))


COND_MODEL = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.cond(h.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,)))


def model():
    return Net()


def example_inputs():
    return (torch.randn(4, 4),)
"""


def test_nested_graph_op_names_the_line_and_the_fix(tmp_path, capsys):
    """torch.cond exports, but its branches are nested graphs a flat stage function cannot hold."""
    path = tmp_path / "cond_model.py"
    path.write_text(COND_MODEL)
    code, text = run_cli(capsys, "split", str(path), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 2, text
    assert "'cond' at cond_model.py:14" in text and "torch.where" in text, text
    assert "Traceback" not in text and "<eval_with_key>" not in text, text


CUSTOM_BACKWARD = '''
import torch
import torch.nn as nn


class Recomputed(torch.autograd.Function):
    """Its forward runs without gradients; its backward recomputes them (as reversible layers do)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        with torch.no_grad():  # as Reformer's layers: the backward below is the only gradient
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            out = ctx.layer(x)
            torch.autograd.backward(out, grad)
        return x.grad, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(Recomputed.apply(x, self.inner)))


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)


def example_target():
    return torch.zeros(4, 4)


def loss_fn(out, target):
    return (out - target).pow(2).mean()
'''


def test_recomputing_backward_is_checked_against_autograd_and_its_forward_recorded(tmp_path, capsys):
    # Reformer's reversible layers: an autograd.Function whose forward runs without gradients and whose backward
    # recomputes them. torch.export keeps the forward only: split, the layers would never train (the run used to fail
    # in backward with "element 0 of tensors does not require grad"; then it was refused, asking for the model file
    # to change). Its backward is autograd's derivative of its forward, checked by one eager step each way, so the
    # forward is traced again with the layers recorded and the parameters train
    path = tmp_path / "custom_backward.py"
    path.write_text(CUSTOM_BACKWARD)
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0, text
    assert ("Recomputed.apply at custom_backward.py:32: torch.autograd.Function(s) with a backward of their own; "
            "split, the gradient through them is autograd's derivative of their forward, which equals their own "
            "backward on the example microbatch") in text, text
    assert "traced again with those layers recorded" in text, text
    # planned on meta weights the eager check has no values to run: refused as before, with the fix in the model file
    from tracepp.modelfile import load_model_file
    from tracepp.trace import TraceError, trace

    with pytest.raises(TraceError) as refused:
        trace(load_model_file(str(path)), 2, on_meta=True)
    assert ("Recomputed.apply at custom_backward.py:32 is a torch.autograd.Function with a backward of its own, and "
            "the 2 parameters it uses (inner.bias, inner.weight) are read with gradients off inside it") in str(
        refused.value)


CUT_GRAPH = CUSTOM_BACKWARD.replace('''            return layer(x)''', '''            y = layer(x.detach())
        return y.detach_()  # memcnn's InvertibleCheckpointFunction: its outputs detached in place''')


def test_a_function_whose_forward_cuts_the_graph_is_refused_naming_what_would_not_train(tmp_path, capsys):
    # memcnn's InvertibleCheckpointFunction detaches its inputs and, in place, its outputs: even recorded with
    # gradients on, its forward trains nothing before it. The refusal told the user to run that forward as ordinary
    # code (which trains nothing); it now names the tensors its own backward trains and autograd's does not reach
    path = tmp_path / "cut_graph.py"
    path.write_text(CUT_GRAPH)
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 2, text
    assert ("Recomputed.apply at cut_graph.py:33: torch.autograd.Function(s) with a backward of their own, whose "
            "forward cuts the graph itself") in text, text
    assert ("their own backward gives 3 tensor(s) a gradient (inner.weight, inner.bias, the model's input 0)"
            in text), text
    assert "build the model without the function" in text and "Traceback" not in text, text


STRAIGHT_THROUGH = CUSTOM_BACKWARD.replace('''class Recomputed(torch.autograd.Function):''', '''class Rounded(torch.autograd.Function):
    """Rounds in the forward; its backward passes half the gradient (a straight-through estimator, scaled)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return SCALE * grad


class Recomputed(torch.autograd.Function):''').replace("torch.tanh(Recomputed.apply(x, self.inner))",
                                                        "torch.tanh(Rounded.apply(self.inner(x)))")


def test_a_straight_through_estimator_is_traced_as_one(tmp_path, capsys):
    # HF BitNet's WeightQuant and ActQuant: a round (derivative zero) whose backward passes the gradient through.
    # torch.export keeps the forward: split, the layers before it never trained, with only a note. Each call's backward
    # is found to pass its output's gradient to its input unchanged, the Function is traced as x + (f(x) - x).detach(),
    # and one eager step each way agrees
    path = tmp_path / "straight_through.py"
    path.write_text(STRAIGHT_THROUGH.replace("SCALE * grad", "grad"))
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0, text
    assert ("Rounded.apply at straight_through.py:44: straight-through estimators, their backward passing the "
            "gradient through unchanged, traced as x + (f(x) - x).detach()), which equals their own backward") in text


def test_a_backward_that_is_not_the_forwards_derivative_is_refused_with_the_difference(tmp_path, capsys):
    # a straight-through estimator passing half the gradient: neither autograd's derivative of its forward (zero) nor
    # the gradient unchanged. Split, it trained with autograd's zero, with only a note saying whose backward was not
    # kept. One eager step with its own backward and one with autograd's now differ, and the split says by how much,
    # where, and how to write it
    path = tmp_path / "straight_through.py"
    path.write_text(STRAIGHT_THROUGH.replace("SCALE * grad", "0.5 * grad"))
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 2, text
    assert "Rounded.apply at straight_through.py:" in text, text
    assert "with a backward of their own that is not autograd's derivative of their forward" in text, text
    found = re.search(r"gives gradients ([0-9.e+-]+) apart \(relative to the largest gradient; at inner\.", text)
    assert found and float(found.group(1)) > 0.1, text
    assert "y.detach() + s * (y - y.detach())" in text and "Traceback" not in text, text
    # written as the message says, it splits
    path.write_text(STRAIGHT_THROUGH.replace("torch.tanh(Rounded.apply(self.inner(x)))",
                                             "torch.tanh(self.rounded(self.inner(x)))") + """

def _rounded(self, x):
    return (torch.round(x * 4) / 4).detach() + 0.5 * (x - x.detach())


Net.rounded = _rounded
""")
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0, text


def test_each_nodes_stack_trace_is_the_one_torch_fx_records(monkeypatch):
    """trace._export takes each node's stack trace from the frames fx keeps only (issue 56: 22% of a 671B model's
    trace went to symbolizing frames fx then dropped): on a Hugging Face Llama every node's ``stack_trace`` is the
    string fx's own capture writes, and the split's source-line messages read the same text."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tracepp import trace

    config = LlamaConfig(use_cache=False, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (1, 8))

    def stacks(how: str) -> dict:
        monkeypatch.setenv("TRACEPP_FX_STACKS", how)
        program = trace._export(model, (ids,), {}, None)
        return {node.name: node.meta.get("stack_trace") for node in program.graph.nodes}

    theirs, ours = stacks("torch"), stacks("kept")
    assert theirs == ours
    recorded = [text for text in ours.values() if text]
    assert len(recorded) > 100 and all("modeling_llama.py" in text for text in recorded[:50])


def test_custom_function_autograd_cannot_differentiate_is_refused_by_name(tmp_path, capsys):
    # mambapy's parallel scan: a torch.autograd.Function with a backward of its own whose forward scans in place on
    # views. torch.export keeps the forward only, and autograd cannot differentiate it: the run used to fail in
    # backward ("one of the variables needed for gradient computation has been modified by an inplace operation")
    code, text = run_cli(capsys, "split", model_path("mamba_pscan"), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 2, text
    assert "PScan.apply at lib_style.py:" in text and "with a backward of its own" in text, text
    assert "its in-place ops (aten.add_.Tensor at lib_style.py:" in text, text
    assert "MambaConfig(pscan=False)" in text and "Traceback" not in text, text
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_custom_function_without_pscan_splits(tmp_path, capsys, monkeypatch):
    # the fix the refusal names: the model's path without the function (mambapy's pscan=False) splits
    monkeypatch.setenv("MAMBA_PSCAN", "0")
    code, text = run_cli(capsys, "check", model_path("mamba_pscan"), "--ranks", "2")
    assert code == 0, text


CUSTOM_GELU = '''
import torch
import torch.nn as nn


class GeLUFunction(torch.autograd.Function):
    """BLOOM's GeLU (transformers' modeling_bloom.py): the tanh approximation with a backward of its own."""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return input * 0.5 * (1.0 + torch.tanh(0.79788456 * input * (1 + 0.044715 * input * input)))

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * grad_output


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(GeLUFunction.apply(self.a(x)))


def model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 8),)


def example_target():
    return torch.zeros(4, 4)


def loss_fn(out, target):
    return (out - target).pow(2).mean()
'''


def test_a_module_whose_attributes_raise_does_not_stop_the_check(tmp_path, capsys, monkeypatch):
    # absl's FLAGS (imported by tensorboard) parses sys.argv on any attribute read before the flags are parsed: the
    # search for module-level names bound to a Function's apply read `__self__` of every module's values, and the
    # whole suite's run of these tests stopped with "UnrecognizedFlagError: Unknown command line flag 'q'"
    import sys
    import types

    class UnrecognizedFlagError(Exception):
        pass

    class Flags:
        def __call__(self, *args):
            return None

        def __getattr__(self, name):
            raise UnrecognizedFlagError(f"Unknown command line flag {name!r}")

    held = types.ModuleType("flags_like_absl")
    held.FLAGS = Flags()
    monkeypatch.setitem(sys.modules, "flags_like_absl", held)
    path = tmp_path / "custom_gelu.py"
    path.write_text(CUSTOM_GELU)
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0 and "which equals their own backward" in text, text


def test_custom_function_autograd_differentiates_is_split_with_a_note(tmp_path, capsys):
    # BLOOM's GeLU: its forward differentiates, so the split goes on, saying whose backward is not kept
    path = tmp_path / "custom_gelu.py"
    path.write_text(CUSTOM_GELU)
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0, text
    assert "GeLUFunction.apply at custom_gelu.py:28: torch.autograd.Function(s) with a backward of their own" in text


_CPU_MASK_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        # a tensor made on the CPU whatever the weights' device (CPM-Ant's mask): on meta weights this mixes devices
        return x.masked_fill(torch.zeros(x.shape[-1], dtype=torch.bool), 0.0)


def model():
    return Net()


def example_inputs():
    return (torch.randn(4, 64),)


def example_target():
    return torch.zeros(4, 64)


def loss_fn(out, target):
    return F.mse_loss(out, target)
'''


def test_a_model_that_does_not_trace_on_meta_and_would_not_fit_for_real_is_refused_with_the_sizes(
        tmp_path, capsys, monkeypatch):
    # the retry with real weights would build the whole model in host memory: where it does not fit (CPM-Ant at its
    # default 9.5B, fp32: 35.5 GiB on a 24 GiB machine) the split was killed without a word; it now says why
    from tracepp import trace as trace_module
    from tracepp.runtime import memory_fit

    path = tmp_path / "cpu_mask.py"
    path.write_text(_CPU_MASK_MODEL)
    monkeypatch.setattr(trace_module, "REAL_TRACE_LIMIT_BYTES", 0)  # planned on meta, as a large model is
    out = str(tmp_path / "out")
    assert run_cli(capsys, "split", str(path), "--out", out, "--ranks", "2")[0] == 0  # fits: traced for real
    monkeypatch.setattr(memory_fit, "available_ram", lambda: 10_000)  # 10 kB free: 66 kB of weights do not fit
    code, text = run_cli(capsys, "split", str(path), "--out", out, "--ranks", "2")
    assert code != 0
    assert "does not trace with meta weights" in text, text
    assert "would need 0.1 MiB of its 16.6K parameters and buffers" in text and "where 0.0 MiB are free" in text, text
    assert "cpu_mask.py" in text, text  # the line that mixes the devices


def test_a_model_on_meta_weights_that_makes_a_tensor_on_its_inputs_device_is_traced_with_inputs_on_meta(
        tmp_path, monkeypatch):
    # CPM-Ant makes its attention mask on the token ids' device (the CPU) and meets its scores on meta: traced again
    # with the inputs on meta too, it plans at its default 9.5B without real weights (it needed 35.5 GiB before)
    from tracepp import trace as trace_module
    from tracepp.driver import check_model
    from tracepp.runtime import memory_fit
    from tracepp.runtime.mesh import Layout

    path = tmp_path / "input_device_mask.py"
    path.write_text(_CPU_MASK_MODEL.replace("torch.zeros(x.shape[-1], dtype=torch.bool)",
                                            "torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)"))
    monkeypatch.setattr(trace_module, "REAL_TRACE_LIMIT_BYTES", 0)  # planned on meta, as a large model is
    monkeypatch.setattr(memory_fit, "available_ram", lambda: 10_000)  # and no memory for real weights
    manifest = check_model(str(path), schedule="gpipe", num_microbatches=2, layout=Layout(pp=2, tp=2), verify="on")
    assert any("traced with its inputs on meta too" in note for note in manifest["notes"]), manifest["notes"]
    assert manifest["tp"]["verified"]["status"] == "verified", manifest["tp"]["verified"]


_CONTRACT = """

def example_inputs():
    return (torch.randn(4, 8),)


def example_target():
    return torch.randn(4, 8)


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)
"""  # the model files' shared contract: 4 samples of 8 features


GRAD_MODE_FORWARD = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    @DECORATOR
    def forward(self, x):
        return self.b(self.a(x).relu())


class Frozen(Net):  # a frozen part under no_grad before a trained one: trains as eager does
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)
        for p in (*self.a.parameters(), *self.b.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(super().forward(x))


def model():
    torch.manual_seed(0)
    return MODEL()

""" + _CONTRACT


@pytest.mark.parametrize("decorator, refused", [("torch.inference_mode()", "runs under torch.inference_mode()"),
                                                ("torch.no_grad()", "no gradient of the loss reaches any of the "
                                                                    "model's 4 trainable parameters")])
def test_a_forward_that_turns_gradients_off_is_refused_by_name(tmp_path, capsys, decorator, refused):
    # Meta's reference Llama (llama-models) decorates Transformer.forward with @torch.inference_mode(): eager cannot
    # train it, torch.export drops the mode, and the split trained it anyway; under no_grad the split was written
    # and its ranks failed in backward
    path = tmp_path / "grad_mode.py"
    path.write_text(GRAD_MODE_FORWARD.replace("DECORATOR", decorator).replace("MODEL", "Net"))
    code, text = run_cli(capsys, "split", str(path), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 2, text
    assert refused in text and "Net.forward" in text and "grad_mode.py:11" in text, text  # the decorator's line
    assert "drop loss_fn" in text and "Traceback" not in text, text
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_frozen_part_under_no_grad_splits(tmp_path, capsys):
    path = tmp_path / "frozen.py"
    path.write_text(GRAD_MODE_FORWARD.replace("DECORATOR", "torch.no_grad()").replace("MODEL", "Frozen"))
    code, text = run_cli(capsys, "split", str(path), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 0, text


CHECKPOINTED = """
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if REENTRANT:
            h = checkpoint(self.b, h, use_reentrant=True)
        else:
            with torch.no_grad():  # computed without gradients: a and b take none, in eager as split
                h = h + self.b(h)
        return self.c(h.relu())


def model():
    torch.manual_seed(0)
    return Net()

""" + _CONTRACT


def test_a_reentrant_checkpoint_is_traced_with_its_function_recorded(tmp_path, capsys):
    # gateloop-transformer's default checkpointing (torch.utils.checkpoint, use_reentrant=True): torch.export traces
    # everything from it on with gradients off; the split was written and its ranks failed in backward, then it was
    # refused by name. torch's CheckpointFunction recomputes in its backward what autograd records of its forward: the
    # two agree on one eager step, so the forward is traced again with the function run recorded, and it splits
    path = tmp_path / "checkpointed.py"
    path.write_text(CHECKPOINTED.replace("REENTRANT", "True"))
    code, text = run_cli(capsys, "split", str(path), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 0, text
    assert "CheckpointFunction.apply at checkpointed.py:" in text and "traced again" in text, text
    assert "no gradient of the loss reaches" not in text and "take no gradient" not in text, text


def test_what_no_recorded_forward_reaches_is_still_refused_by_name(tmp_path, capsys, monkeypatch):
    # where the eager check cannot record the forward (here: it is switched off by making every comparison fail to
    # run), a reentrant checkpoint is refused by name as before, with the op, its line and the fix
    from tracepp import custom_functions

    monkeypatch.setattr(custom_functions, "compare", lambda *args: None)
    path = tmp_path / "checkpointed.py"
    path.write_text(CHECKPOINTED.replace("REENTRANT", "True"))
    code, text = run_cli(capsys, "split", str(path), "-o", str(tmp_path / "out"), "--ranks", "2")
    assert code == 2, text
    assert "no gradient of the loss reaches" in text and "checkpointed.py:" in text, text
    assert "use_reentrant=False" in text, text
    assert re.search(r"at \w+ \([\w.]+\) at checkpointed\.py:\d+", text), text  # the op too (the study's "by name")


COMPLEX_PATH = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_a, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        a = torch.view_as_complex(self.to_a(x).view(-1, 4, 2))  # gateloop-transformer's state transition
        a = torch.polar(a.abs().sigmoid(), a.angle())
        return self.out(torch.view_as_real(a).reshape(-1, 8))


def model():
    torch.manual_seed(0)
    return Net()

""" + _CONTRACT


def test_a_gradient_through_complex_values_reaches_its_parameters(tmp_path, capsys):
    # gateloop-transformer's to_a (a linear viewed as complex, its magnitude and phase through torch.polar): its
    # parameters train, in eager as split, but the split's note said they took no gradient ("every path from them to
    # the output passes a region without gradients"): a complex value was not counted as one that carries a gradient
    path = tmp_path / "complex_path.py"
    path.write_text(COMPLEX_PATH)
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0, text
    assert "take no gradient" not in text, text


def test_parameters_read_only_without_gradients_are_named_in_a_note(tmp_path, capsys):
    path = tmp_path / "checkpointed.py"
    path.write_text(CHECKPOINTED.replace("REENTRANT", "False"))
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0, text
    assert "4 trainable parameter(s) take no gradient in the traced program (a.weight, a.bias, b.weight and 1 more)" \
        in text, text


def test_no_note_where_gradients_pass_a_chunk(tmp_path, capsys):
    # chunk's and split's outputs are a list: the gradient path stopped there, and litgpt's LoRA, whose qkv product is
    # split by sizes, was told its lora_A and lora_B take no gradient
    path = tmp_path / "chunked.py"
    path.write_text(CHUNKED)
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    assert code == 0 and "take no gradient" not in text, text


CHUNKED = """
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 8)

    def forward(self, x):
        u, v = self.a(x).chunk(2, dim=-1)
        return self.b(u * torch.sigmoid(v))


def model():
    torch.manual_seed(0)
    return Net()

""" + _CONTRACT


UNSEEDED = """
import random

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.pick = nn.Parameter(torch.zeros(4))
        with torch.no_grad():  # hyper-connections: each block's initial residual stream, random.randrange
            self.pick[random.randrange(4)] = 1.0

    def forward(self, x):
        return self.a(x) * self.pick.sum()


def model():
    torch.manual_seed(0)
    SEEDING
    return Net()

""" + _CONTRACT


@pytest.mark.parametrize("seeding, refused", [("pass", True), ("random.seed(0)", False)])
def test_a_model_that_draws_from_an_unseeded_python_random_is_refused(tmp_path, capsys, seeding, refused):
    # recurrent-memory-transformer's hyper-connections: every rank's model() built other weights, and the split
    # trained to parameters 1.0 away from eager with no warning
    path = tmp_path / "unseeded.py"
    path.write_text(UNSEEDED.replace("SEEDING", seeding))
    code, text = run_cli(capsys, "check", str(path), "--ranks", "2")
    if refused:
        assert code == 2 and "builds other weights (pick)" in text and "random.seed(0)" in text, text
    else:
        assert code == 0, text
