"""Materialise one rank's parameters and buffers, and nothing more: from a checkpoint or from the model file.

``tracepp split`` writes no weights. At start-up each rank calls :func:`load_rank_state`, which returns
FQN -> tensor for the state its stages read (``nn.Parameter`` for trainable parameters), on its device:

- ``--load PATH``: a checkpoint keyed by the original model's FQNs: a torch ``state_dict`` file (read with
  ``torch.load(mmap=True, weights_only=True)``), a ``.safetensors`` file, a Hugging Face folder of sharded
  safetensors with ``model.safetensors.index.json``, or a ``torch.distributed.checkpoint`` folder. Only this
  rank's tensors are read. Every rank first checks the whole checkpoint's key list and shapes against the
  manifest (metadata only), so a missing key or a wrong shape stops every rank, by name, before any step.
- ``--init model`` (default): build ``model()`` on the CPU and keep this rank's tensors; the initial values
  equal eager ``model()``'s exactly, but the whole model passes through memory once (small models).
- ``--init per-module``: build ``model()`` with parameters on the meta device, then give storage only to the
  modules owning this rank's parameters and initialise each with the model file's ``init_weights(module)``,
  the Hugging Face model's ``_init_weights``, or the module's ``reset_parameters()``, under a seed derived from
  the module's FQN: values do not depend on the split and the whole model is never built.

Buffers that are not in a checkpoint (a rotary ``inv_freq``) come from ``model()`` built with parameters on
meta (buffers are small and computed at init). Imports torch and the standard library only (safetensors
files are read by their documented layout: an 8-byte header length, a JSON header, raw little-endian data).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys

import torch

from .failure import PipelineError, agree

INIT_MODES = ("model", "per-module")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES_SHOWN = 8


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))


def _short(names: list) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _NAMES_SHOWN else "")


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[tracepp] {text}", flush=True)


# ---- what a rank needs

def state_entries(manifest: dict, rank=None) -> dict:
    """FQN -> manifest state entry for the stages on ``rank`` (every stage when ``rank`` is None). Rank 0 also
    gets the state no stage reads (as plain tensors), so ``--save`` can write a complete state_dict."""
    entries: dict = {}
    for stage in manifest["stages"]:
        if rank is not None and manifest["plan"]["stage_to_rank"][stage["index"]] != rank:
            continue
        for ref in stage["state"]:
            entries.setdefault(ref["fqn"], ref)
    if rank is None or rank == 0:
        for item in manifest.get("unused_state", []):
            entries.setdefault(item["fqn"], {"fqn": item["fqn"], "aliases": [item["fqn"]], "kind": "buffer",
                                             "persistent": True, "requires_grad": False, "unused": True,
                                             "shape": item["shape"], "dtype": item["dtype"]})
    return entries


def _in_checkpoint(ref: dict) -> bool:
    """Parameters and persistent buffers are in a state_dict; constants and non-persistent buffers are not."""
    return ref["kind"] == "parameter" or (ref["kind"] == "buffer" and ref.get("persistent", True))


def _finish(ref: dict, tensor: torch.Tensor, device: torch.device, piece=None) -> torch.Tensor:
    if piece is not None:  # tensor parallel: this rank's shard, cut before it reaches the device
        tensor = piece(ref["fqn"], tensor)
    tensor = tensor.to(device=device, dtype=_dtype(ref["dtype"])).contiguous()
    if ref["kind"] == "parameter" and not ref.get("unused"):
        return torch.nn.Parameter(tensor, requires_grad=ref.get("requires_grad", True))
    return tensor


def load_rank_state(folder: str, manifest: dict, rank: int, device: torch.device, user, load=None,
                    init: str = "model", piece=None, rows=None) -> dict:
    """FQN -> tensor for every parameter/buffer this rank's stages read; one object per FQN on a rank.
    ``piece(fqn, tensor)``: what of each tensor this process keeps (tensor parallelism: its shard), taken on
    the CPU as the tensor is read, so a tp rank's device never holds the whole weight. ``rows(fqn, shape)``:
    ``(dim 0, start, stop)`` of the rows a checkpoint reader reads of a tensor instead of all of it (expert
    parallelism: this rank's experts), or None."""
    mine = state_entries(manifest, rank)
    if load:
        reader, keys, problem = None, None, None
        try:
            reader = open_checkpoint(load)
            keys = check_checkpoint(reader, manifest, rank)
        except PipelineError as error:
            problem = str(error)
        agree(problem)  # every rank names the problem itself, none is stopped first by a faster peer's report
        wanted = {fqn: keys[fqn] for fqn, ref in mine.items() if _in_checkpoint(ref)}
        loaded = reader.read(wanted, _row_ranges(reader, wanted, rows))
        others = {fqn: ref for fqn, ref in mine.items() if not _in_checkpoint(ref)}
        skeleton = build_without_parameters(user) if others else None
        state = {fqn: _finish(mine[fqn], tensor, device, piece) for fqn, tensor in loaded.items()}
        state.update(_from_model(folder, skeleton, others, device, piece))
        _say(rank, f"loaded {len(loaded)} tensors from {load}")
        return state
    if init == "model":
        return _from_model(folder, user.model(), mine, device, piece)
    if init == "per-module":
        return _per_module(folder, user, mine, device, piece)
    raise PipelineError(f"--init {init!r} is not one of {', '.join(INIT_MODES)}")


# ---- from the model file

def _attribute(model: torch.nn.Module, fqn: str):
    owner = model
    for part in fqn.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner if isinstance(owner, torch.Tensor) else None


def _from_model(folder: str, model, wanted: dict, device: torch.device, piece=None) -> dict:
    """Take ``wanted`` by FQN from a built model (or, for constants export created, from constants.pt)."""
    if not wanted:
        return {}
    created_path = os.path.join(folder, "constants.pt")
    created = torch.load(created_path, weights_only=True) if os.path.exists(created_path) else {}
    state = {}
    for fqn, ref in wanted.items():
        tensor = created.get(fqn)
        if tensor is None:
            tensor = next((t for t in (_attribute(model, name) for name in [fqn] + ref["aliases"])
                           if t is not None), None)
        if tensor is None or tensor.is_meta:
            raise PipelineError(f"'{fqn}' has no value: it is not a tensor attribute of model() with storage; "
                                f"load it from a checkpoint with --load, or use --init model")
        state[fqn] = _finish(ref, tensor.detach().clone(), device, piece)
    return state


def held_state(model: torch.nn.Module) -> dict:
    """FQN -> tensor for every parameter and persistent buffer the model's modules hold, under every FQN (a tied
    weight under each alias), in ``state_dict()`` order: what ``state_dict()`` gives before its hooks. A module's
    state_dict hooks may save other tensors under other names (torchtitan's fused qkv saves new ``wq``, ``wk``,
    ``wv`` tensors cut from the ``wqkv`` it holds); those are not the model's state, only its saved layout."""
    state = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                state[prefix + name] = param
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                state[prefix + name] = buffer
    return state


def in_model_layout(user, state: dict) -> dict:
    """``state`` (:func:`held_state`'s keys) as the model's own ``state_dict()`` saves it, hooks included: the model
    built with parameters on meta, each held tensor put in its place, then its ``state_dict()``. For a model whose
    modules save another layout than they hold (manifest ``state_dict_hooks``), so that ``--save`` writes what
    ``model().load_state_dict`` reads."""
    model = build_without_parameters(user)
    for fqn, tensor in state.items():
        owner_name, _, name = fqn.rpartition(".")
        owner = model.get_submodule(owner_name)
        if name in owner._parameters:
            owner._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
        elif name in owner._buffers:
            owner._buffers[name] = tensor
    saved = {fqn: tensor.detach() for fqn, tensor in model.state_dict().items()}
    missing = [fqn for fqn, tensor in saved.items() if tensor.is_meta]
    if missing:
        raise PipelineError(f"--save: the model's state_dict() names {len(missing)} tensor(s) the pipeline does not "
                            f"hold ({_short(missing)}): its state_dict hooks read a tensor the split did not record")
    return saved


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside, every parameter a module registers is moved to the meta device (buffers stay real)."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def build_without_parameters(user) -> torch.nn.Module:
    """``model()`` with parameters on meta (no storage) and real buffers (computed at init, small)."""
    with _parameters_on_meta():
        return user.model()


def _fqn_seed(fqn: str) -> int:
    return int.from_bytes(hashlib.sha256(fqn.encode()).digest()[:8], "little") % (2 ** 63)


def _per_module(folder: str, user, mine: dict, device: torch.device, piece=None) -> dict:
    model = build_without_parameters(user)
    modules = dict(model.named_modules())
    owners = sorted({fqn.rpartition(".")[0] for fqn, ref in mine.items()
                     if ref["kind"] == "parameter" or ref.get("unused")})
    custom = getattr(user, "init_weights", None)
    for owner in owners:
        module = modules[owner]
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                               requires_grad=param.requires_grad)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_fqn_seed(owner))
            with torch.no_grad():
                if custom is not None:
                    custom(module)
                elif hasattr(model, "_init_weights"):  # a Hugging Face PreTrainedModel's own initialiser
                    model._init_weights(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
                else:
                    raise PipelineError(
                        f"--init per-module: module '{owner}' ({type(module).__name__}) has no reset_parameters(); "
                        f"define init_weights(module) in the model file, or use --init model or --load CKPT")
    return _from_model(folder, model, mine, device, piece)


# ---- checkpoints

class _TorchFile:
    """A ``torch.save``d state_dict, memory-mapped: only the tensors read are paged in."""

    def __init__(self, path: str):
        self.path = path
        self.tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(self.tensors, dict):
            raise PipelineError(f"--load {path}: holds a {type(self.tensors).__name__}, not a state_dict")

    def metadata(self) -> dict:
        return {k: (list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in self.tensors.items()
                if isinstance(v, torch.Tensor)}

    def read(self, keys: dict, rows=None) -> dict:
        """``rows``: {fqn: (start, stop)} of dim 0 to read (the mapped file pages in only those)."""
        rows = rows or {}
        return {fqn: (self.tensors[key][slice(*rows[fqn])] if fqn in rows else self.tensors[key]).clone()
                for fqn, key in keys.items()}


class _SafetensorsFiles:
    """One ``.safetensors`` file, or a folder of shards named by ``model.safetensors.index.json``."""

    def __init__(self, files: list, weight_map=None):
        self.headers = {}
        for path in files:
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            header.pop("__metadata__", None)
            self.headers[path] = (8 + length, header)
        self.file_of = {key: path for path, (_, header) in self.headers.items() for key in header}
        if weight_map is not None:
            for key, path in weight_map.items():
                if key not in self.file_of:
                    raise PipelineError(f"--load: the index names '{key}' in {path}, which does not hold it")

    def metadata(self) -> dict:
        result = {}
        for key, path in self.file_of.items():
            entry = self.headers[path][1][key]
            name = _SAFETENSORS_DTYPES.get(entry["dtype"])
            result[key] = (entry["shape"], str(name).replace("torch.", "") if name else entry["dtype"])
        return result

    def read(self, keys: dict, rows=None) -> dict:
        """``rows``: {fqn: (start, stop)} of dim 0 to read: only those bytes are read from the file."""
        rows = rows or {}
        result = {}
        by_file: dict = {}
        for fqn, key in keys.items():
            by_file.setdefault(self.file_of[key], []).append((fqn, key))
        for path, items in by_file.items():
            start, header = self.headers[path]
            with open(path, "rb") as handle:
                for fqn, key in items:
                    entry = header[key]
                    begin, end = entry["data_offsets"]
                    shape = list(entry["shape"])
                    if fqn in rows and shape:  # rows [first, last) of dim 0: one contiguous byte range
                        first, last = rows[fqn]
                        row_bytes = (end - begin) // shape[0] if shape[0] else 0
                        begin, end, shape[0] = begin + first * row_bytes, begin + last * row_bytes, last - first
                    handle.seek(start + begin)
                    data = bytearray(end - begin)
                    handle.readinto(data)
                    dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
                    tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
                    result[fqn] = tensor.reshape(shape)
        return result


class _DistributedCheckpoint:
    """A ``torch.distributed.checkpoint`` folder keyed by FQNs: read into pre-allocated tensors, per rank."""

    def __init__(self, path: str):
        import torch.distributed.checkpoint as dcp

        self.path = path
        self.dcp = dcp
        self.meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata

    def metadata(self) -> dict:
        return {k: (list(v.size), str(v.properties.dtype).replace("torch.", "")) for k, v in self.meta.items()
                if hasattr(v, "size")}

    def read(self, keys: dict, rows=None) -> dict:
        if not keys:
            return {}
        buffers = {key: torch.empty(self.meta[key].size, dtype=self.meta[key].properties.dtype)
                   for key in keys.values()}
        self.dcp.load(buffers, storage_reader=self.dcp.FileSystemReader(self.path), no_dist=True)
        rows = rows or {}
        return {fqn: buffers[key][slice(*rows[fqn])].clone() if fqn in rows else buffers[key]
                for fqn, key in keys.items()}


def _row_ranges(reader, keys: dict, rows) -> dict:
    """{fqn: (start, stop)} of the dim-0 rows to read of each tensor ``rows`` limits (none without it)."""
    if rows is None:
        return {}
    shapes = reader.metadata()
    out = {}
    for fqn, key in keys.items():
        limit = rows(fqn, shapes[key][0]) if key in shapes else None
        if limit is not None and limit[0] == 0:
            out[fqn] = limit[1:]
    return out


def open_checkpoint(path: str):
    """A reader for ``path``, whichever of the four layouts it has."""
    if not os.path.exists(path):
        raise PipelineError(f"--load {path}: no such file or folder (give a .safetensors or torch state_dict "
                            f"file, a Hugging Face folder, or a torch.distributed.checkpoint folder)")
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
            shards = sorted(set(weight_map.values()))
            absent = [s for s in shards if not os.path.exists(os.path.join(path, s))]
            if absent:
                raise PipelineError(f"--load {path}: the index names shard(s) that are not there: {_short(absent)}")
            return _SafetensorsFiles([os.path.join(path, s) for s in shards],
                                     {k: os.path.join(path, v) for k, v in weight_map.items()})
        if os.path.exists(os.path.join(path, ".metadata")):
            return _DistributedCheckpoint(path)
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.exists(os.path.join(path, name)):
                return open_checkpoint(os.path.join(path, name))
        raise PipelineError(f"--load {path}: a folder without model.safetensors.index.json, model.safetensors, "
                            f"pytorch_model.bin or a torch.distributed.checkpoint .metadata file")
    with open(path, "rb") as handle:
        magic = handle.read(2)
    if path.endswith(".safetensors") or magic not in (b"PK", b"\x80\x02"):
        try:
            return _SafetensorsFiles([path])
        except (ValueError, struct.error, UnicodeDecodeError) as error:
            if path.endswith(".safetensors"):
                raise PipelineError(f"--load {path}: not a readable safetensors file ({error})") from error
    return _TorchFile(path)


def check_checkpoint(reader, manifest: dict, rank: int) -> dict:
    """Every rank checks the whole model against the checkpoint's metadata (no data read), so every rank
    names the same problem before any step. Returns canonical FQN -> the key the checkpoint holds it under."""
    available = reader.metadata()
    keys, missing, wrong_shape, cast = {}, [], [], []
    for fqn, ref in state_entries(manifest).items():
        if not _in_checkpoint(ref):
            continue
        key = next((name for name in [fqn] + ref["aliases"] if name in available), None)
        if key is None:
            missing.append(fqn)
            continue
        shape, dtype = available[key]
        if list(shape) != list(ref["shape"]):
            wrong_shape.append(f"{key}: checkpoint {list(shape)}, model {ref['shape']}")
        elif dtype != ref["dtype"]:
            cast.append(f"{key} ({dtype} -> {ref['dtype']})")
        keys[fqn] = key
    problems = []
    if missing:
        example = next(iter(available), None)
        hint = (f"; the checkpoint's keys look like '{example}', the model's like '{missing[0]}' (a prefix that "
                f"differs means another model or a wrapper's state_dict: save the model's own state_dict)"
                if example is not None and len(missing) * 2 > len(keys) + len(missing) else "")
        problems.append(f"{len(missing)} tensor(s) the model needs are not in the checkpoint: {_short(missing)}{hint}")
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} tensor(s) have another shape: {_short(wrong_shape)}")
    if problems:
        raise PipelineError(f"--load: the checkpoint does not fit the model: " + "; ".join(problems) +
                            " (nothing was loaded; check --load names the checkpoint of this model)")
    known = set(manifest["state_dict_keys"])
    for ref in state_entries(manifest).values():
        known.update(ref["aliases"])
    unexpected = sorted(k for k in available if k not in known)
    if unexpected:
        _say(rank, f"note: --load: {len(unexpected)} checkpoint key(s) the model does not use, ignored: "
                   f"{_short(unexpected)}")
    if cast:
        _say(rank, f"note: --load: {len(cast)} tensor(s) converted to the model's dtype: {_short(cast)}")
    return keys
