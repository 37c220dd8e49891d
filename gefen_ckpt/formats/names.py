"""Names for optimizer state_dicts saved without them.

``torch.optim.AdamW(model.parameters())`` (e.g. the HuggingFace Trainer's) saves a state_dict
keyed by position only. The names come from a list (one FQN per position) or from the model's
state_dict, in ``named_parameters()`` order: each param group's members are a subsequence of the
model's parameters (HuggingFace's decayed and undecayed groups), other entries (buffers, frozen
parameters) are skipped, and every saved shape must agree. The match must be unique.
"""

from __future__ import annotations

import json

import fsspec
import torch

from gefen.contract import composite_children
from gefen_ckpt.errors import CheckpointFormatError, CheckpointMismatchError
from gefen_ckpt.formats.torch_file import check_state_dict, known_contracts, torch_load
from gefen_ckpt.io.storage import require_regular

__all__ = ["name_state_dict", "read_param_names", "read_model_params"]

#: more partial matches than this means the shapes do not pin the names down
_MAX_FRONTIER = 100_000


def read_param_names(url: str) -> list[str]:
    """A JSON list of FQNs, or one FQN per line (blank lines ignored)."""
    require_regular(*fsspec.core.url_to_fs(url), url)
    with fsspec.open(url, "r", encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointFormatError(f"{url}: not a JSON list of names ({exc})") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CheckpointFormatError(f"{url}: a JSON names file must hold a list of strings")
    else:
        names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(set(names)) != len(names):
        dup = next(n for i, n in enumerate(names) if n in names[:i])
        raise CheckpointFormatError(f"{url}: name {dup!r} appears twice")
    return names


def read_model_params(url: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a model's parameters in ``named_parameters()`` order, from a
    ``torch.save(model.state_dict())`` file or a directory holding ``pytorch_model.bin`` (or its
    shards). Entries sharing storage with an earlier one (tied weights) are dropped, as
    ``named_parameters()`` lists a tied parameter once; integer entries (buffers such as
    ``num_batches_tracked``) cannot be parameters and are dropped too.

    safetensors files are refused: they store tensors sorted by dtype and name, not in the
    model's order, and transformer layers of equal shapes would be matched silently wrong.
    """
    fs, path = fsspec.core.url_to_fs(url)
    files = [url]
    if fs.isdir(path):
        listing = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
        shards = [n for n in listing if n.startswith("pytorch_model") and n.endswith(".bin")]
        if not shards and any(n.endswith(".safetensors") for n in listing):
            _refuse_safetensors(url)
        if not shards:
            raise CheckpointFormatError(f"{url}: no pytorch_model*.bin in this directory")
        files = [f"{url.rstrip('/')}/{n}" for n in shards]  # HF numbers its shards in model order
    elif path.endswith(".safetensors"):
        _refuse_safetensors(url)
    out, seen = [], set()
    for file in files:
        for name, t in _load_model_state_dict(file).items():
            if not isinstance(t, torch.Tensor):
                raise CheckpointFormatError(f"{file}: entry {name!r} is a {type(t).__name__}, not a tensor")
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
            if key in seen or not (t.is_floating_point() or t.is_complex()):
                continue
            seen.add(key)
            out.append((str(name), tuple(t.shape)))
    return out


def _load_model_state_dict(url: str) -> dict:
    sd = torch_load(url, "a torch.save'd model state_dict", mmap=True)
    if not isinstance(sd, dict):
        raise CheckpointFormatError(f"{url}: holds a {type(sd).__name__}, not a model state_dict")
    if "state" in sd and "param_groups" in sd:  # e.g. the optimizer's own file given as the model
        raise CheckpointFormatError(f"{url} is an optimizer state_dict, not a model's: the names come from the "
                                    "model's torch.save(model.state_dict()) file (or its Hugging Face directory)")
    return sd


def _refuse_safetensors(url: str):
    raise CheckpointFormatError(
        f"{url}: safetensors does not keep the order of the model's parameters (it sorts tensors by dtype and "
        "name), which is what a state_dict without names is keyed by; pass --param-names with the names in "
        "model.named_parameters() order, or a torch.save(model.state_dict()) file")


def name_state_dict(sd: dict, names: list[str] | None = None,
                    model_params: list[tuple[str, tuple[int, ...]]] | None = None, *, source: str = "names") -> dict:
    """A shallow copy of optimizer state_dict ``sd`` whose groups carry ``param_names``.

    ``names``: one FQN per parameter, in the state_dict's order (group by group). ``model_params``:
    the model's (name, shape) in ``named_parameters()`` order, matched as the module docstring
    says. Names already in ``sd`` must agree. ``source`` names the origin in error messages.
    """
    check_state_dict(sd)  # the same structural check as reading any torch state_dict
    if composite_children(sd):
        raise CheckpointMismatchError("a composite optimizer's state_dict names its parameters itself")
    groups = sd["param_groups"]
    like_param = {f.name for c in known_contracts().values() for f in c.fields if f.geometry == "param"}
    shapes = [[_saved_shape(sd["state"].get(i), like_param) for i in g["params"]] for g in groups]
    if (names is None) == (model_params is None):
        raise ValueError("give exactly one of names and model_params")
    if names is not None:
        flat = [s for g in shapes for s in g]
        if len(names) != len(flat):
            raise CheckpointMismatchError(
                f"{source} has {len(names)} names, the state_dict {len(flat)} parameters (first disagreeing index "
                f"{min(len(names), len(flat))})")
        it = iter(names)
        per_group = [[next(it) for _ in g["params"]] for g in groups]
    else:
        per_group = _match(shapes, model_params, source)
    out = dict(sd)
    out["param_groups"] = []
    index = 0
    for g, fqns in zip(groups, per_group):
        saved = g.get("param_names")
        if saved and list(saved) != fqns:
            j = next(j for j, (a, b) in enumerate(zip(saved, fqns)) if a != b)
            raise CheckpointMismatchError(f"index {index + j}: the state_dict names it {saved[j]!r}, {source} "
                                          f"{fqns[j]!r}")
        out["param_groups"].append({**g, "param_names": fqns})
        index += len(fqns)
    return out


def _saved_shape(entry, like_param: set[str]) -> tuple[int, ...] | None:
    """The parameter's shape as its state records it (a field of ``param`` geometry), if any."""
    if not isinstance(entry, dict):
        return None
    return next((tuple(v.shape) for k, v in entry.items() if k in like_param and isinstance(v, torch.Tensor)), None)


def _match(shapes: list[list], model: list[tuple[str, tuple[int, ...]]], source: str) -> list[list[str]]:
    """Assign model entries to the groups' positions in order (see the module docstring).

    A breadth-first walk over the model's entries keeps every partial match (how far each group
    has got) with how many ways reach it (capped at 2) and one way back.
    """
    sizes = [len(g) for g in shapes]
    skips = len(model) - sum(sizes)
    offsets = [sum(sizes[:g]) for g in range(len(sizes))]
    if skips < 0:
        raise CheckpointMismatchError(f"the state_dict has {sum(sizes)} parameters, {source} only {len(model)} "
                                      f"(first disagreeing index {len(model)})")
    frontier = {tuple(0 for _ in sizes): 1}
    back: list[dict] = []
    for i, (_, shape) in enumerate(model):
        nxt, way = {}, {}
        for pos, count in frontier.items():
            moves = [g for g, p in enumerate(pos) if p < sizes[g] and shapes[g][p] in (None, shape)]
            if i - sum(pos) < skips:
                moves.append(-1)  # not a parameter of the optimizer (a buffer, a frozen parameter)
            for g in moves:
                new = pos if g < 0 else pos[:g] + (pos[g] + 1,) + pos[g + 1:]
                nxt[new] = min(2, nxt.get(new, 0) + count)
                way.setdefault(new, (pos, g))
        if not nxt:
            first = min(offsets[g] + p for pos in frontier for g, p in enumerate(pos) if p < sizes[g])
            g = max(k for k in range(len(sizes)) if offsets[k] <= first)
            raise CheckpointMismatchError(
                f"index {first} of the state_dict (shape {shapes[g][first - offsets[g]]}) matches no parameter of "
                f"{source} in order (at {model[i][0]!r}, shape {shape})")
        if len(nxt) > _MAX_FRONTIER:
            raise CheckpointMismatchError(f"the shapes cannot tell {source}'s parameters apart: pass --param-names")
        frontier = nxt
        back.append(way)
    done = tuple(sizes)  # the skip budget leaves no other end state
    if frontier[done] > 1:
        raise CheckpointMismatchError(
            f"{source}'s parameters match the state_dict's in more than one way (equal shapes in different groups, "
            "or parameters without state): pass --param-names")
    per_group = [[""] * n for n in sizes]
    pos = done
    for i in range(len(model) - 1, -1, -1):
        pos, g = back[i][pos]
        if g >= 0:
            per_group[g][pos[g]] = model[i][0]
    return per_group
