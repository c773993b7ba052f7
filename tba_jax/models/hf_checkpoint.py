"""Reading Hugging Face checkpoint folders: the one reader the decoder and encoder imports share.

A folder in Hugging Face layout holds config.json and its weights as one `model.safetensors`
or several shards listed in `model.safetensors.index.json`. This module reads them with NumPy
only (no torch):

- `read_hf_config` and the JSON helpers: parsed files, with errors that name the file;
- `checkpoint_files` / `stored_tensors`: the safetensors files and their tensors' shapes
  (headers only);
- `TensorRule`: how one stored tensor becomes one or more params leaves (and back), with
  the rules every model uses (`copy_rule`, `vector_rule`, `linear_rule`);
- `TensorNaming`: data saying how stored names relate to a layout's names (an optional
  base-model prefix, ignored buffers, legacy spellings);
- `read_tensors`: matches the stored tensors to the expected layout (missing, unexpected
  and misshapen tensors are errors before any data is read), then yields converted arrays
  one tensor at a time; `place_tensors` puts them into a params tree, optionally onto
  shardings.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from safetensors import safe_open

CONFIG_FILENAME = "config.json"
SINGLE_WEIGHTS_FILENAME = "model.safetensors"
INDEX_FILENAME = "model.safetensors.index.json"
SHOWN_NAMES = 5  # how many offending tensor names an error message lists

Path = tuple  # keys into a params dict, e.g. ("blocks", 0, "attn", "wq")
Params = dict[str, Any]


# ----------------------------------------------------------------------------------------
# JSON files
# ----------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON file at `path`; a ValueError naming the file when it is not JSON."""
    path = pathlib.Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"Could not read {path} as JSON ({error}); fix or remove the file."
        ) from error


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object ({...}) in `path`; a ValueError when the file holds anything else."""
    content = read_json(path)
    if not isinstance(content, dict):
        raise ValueError(
            f"{path} holds a JSON {type(content).__name__}, expected an object "
            "({...}) as written by Hugging Face save_pretrained."
        )
    return content


def read_optional_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Like `read_json_object`, but {} when the file does not exist."""
    return read_json_object(path) if os.path.isfile(path) else {}


def read_hf_config(hf_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed config.json of the checkpoint folder `hf_path`."""
    path = os.path.join(hf_path, CONFIG_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: pass the directory a transformers `save_pretrained` wrote "
            "(config.json next to the *.safetensors weights)."
        )
    return read_json_object(path)


# ----------------------------------------------------------------------------------------
# Weight files
# ----------------------------------------------------------------------------------------


def architectures_of(
    hf_config: dict[str, Any], family: str, supported: Iterable[str], default: str, source: str
) -> list[str]:
    """config.json's `architectures` (`[default]` when it lists none); ValueError naming
    `source` (the config.json) when one is not in `supported` for model_type `family`."""
    architectures = hf_config.get("architectures") or [default]
    unknown = [name for name in architectures if name not in set(supported)]
    if unknown:
        raise ValueError(
            f"architectures {unknown} in {source} are not supported for "
            f"model_type {family!r}; tba_jax loads {sorted(set(supported))}."
        )
    return architectures


def checkpoint_files(hf_path: str) -> list[str]:
    """The safetensors files of a checkpoint: from the shard index, or the single file."""
    index_path = os.path.join(hf_path, INDEX_FILENAME)
    if os.path.isfile(index_path):
        names = sorted(set(read_json_object(index_path)["weight_map"].values()))
        files = [os.path.join(hf_path, name) for name in names]
        missing = [path for path in files if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(
                f"{index_path} lists shards that are missing: {missing[:SHOWN_NAMES]}; "
                "copy the whole checkpoint directory."
            )
        return files
    single = os.path.join(hf_path, SINGLE_WEIGHTS_FILENAME)
    if os.path.isfile(single):
        return [single]
    found = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
    if found:
        return found
    others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(hf_path, "*.bin")))
    raise FileNotFoundError(
        f"No *.safetensors weights in {hf_path} (other weight files: {others or 'none'}). "
        "Re-save the model with transformers' `save_pretrained` (safetensors is its default)."
    )


class StoredTensor(NamedTuple):
    file: str
    shape: tuple[int, ...]


def stored_tensors(files: Iterable[str]) -> dict[str, StoredTensor]:
    """Stored tensor name -> its file and shape (reads the headers only)."""
    stored: dict[str, StoredTensor] = {}
    for path in files:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                stored[name] = StoredTensor(path, tuple(f.get_slice(name).get_shape()))
    return stored


# ----------------------------------------------------------------------------------------
# Tensor rules: one per checkpoint tensor, both directions.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """How one checkpoint tensor maps onto params.

    `to_ours(hf_array)` returns one array per path in `paths`; `to_hf(*arrays)` (arrays in
    `paths` order) rebuilds the checkpoint tensor of shape `hf_shape`.
    """

    hf_shape: tuple[int, ...]
    paths: tuple[Path, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]


def copy_rule(path: Path, shape: tuple[int, ...]) -> TensorRule:
    """A tensor stored as it is used (embeddings, norm scales, biases)."""
    return TensorRule(tuple(shape), (path,), lambda w: (w,), lambda w: w)


def vector_rule(path: Path, shape: tuple[int, ...]) -> TensorRule:
    """A flat bias [prod(shape)] <-> ours [*shape]."""
    return TensorRule(
        (math.prod(shape),), (path,), lambda b: (b.reshape(shape),), lambda b: b.reshape(-1)
    )


def linear_rule(path: Path, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> TensorRule:
    """A torch nn.Linear weight [out, in] <-> ours [*in_shape, *out_shape]."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    return TensorRule(
        (n_out, n_in),
        (path,),
        lambda w: (w.T.reshape(*in_shape, *out_shape),),
        lambda w: w.reshape(n_in, n_out).T,
    )


# ----------------------------------------------------------------------------------------
# Stored names -> layout names
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorNaming:
    """How a checkpoint's stored tensor names relate to a layout's names.

    `prefix`: the base-model prefix ("model.", "bert.") a stored name may carry or lack,
    whichever way the layout spells it. `ignored`: regular expressions (searched in the
    name without `prefix`) of stored tensors that are not parameters (buffers, unused
    heads). `renames`: (pattern, replacement) regular-expression substitutions from old or
    alternative spellings to the layout's (legacy LayerNorm gamma/beta, output-embedding
    aliases), applied before the prefix is matched.
    """

    prefix: str = ""
    ignored: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    def renamed(self, name: str) -> str:
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name

    def layout_name(self, name: str, layout: Mapping[str, Any]) -> str | None:
        """The layout name of stored tensor `name`, or None when the layout has none."""
        name = self.renamed(name)
        candidates = (name, self.prefix + name, name.removeprefix(self.prefix))
        return next((candidate for candidate in candidates if candidate in layout), None)

    def is_ignored(self, name: str) -> bool:
        body_name = self.renamed(name).removeprefix(self.prefix)
        return any(re.search(pattern, body_name) for pattern in self.ignored)


def match_tensors(
    stored: Mapping[str, StoredTensor],
    layout: Mapping[str, TensorRule],
    naming: TensorNaming,
    *,
    source: str,
    expected: str,
    advice: str,
) -> dict[str, str]:
    """Stored name -> layout name for every tensor to load.

    Raises a ValueError when a layout tensor is missing, a stored one is neither in the
    layout nor ignored, or a shape differs from the layout's, before any data is read.
    `source` (the folder), `expected` (what the layout describes, e.g. "its llama config
    (head='lm')") and `advice` (what to check) go into the message.
    """
    matched, unexpected = {}, []
    for name in sorted(stored):
        layout_name = naming.layout_name(name, layout)
        if layout_name is not None:
            matched[name] = layout_name
        elif not naming.is_ignored(name):
            unexpected.append(name)
    missing = sorted(set(layout) - set(matched.values()))
    if missing or unexpected:
        raise ValueError(
            f"The weights in {source} do not match {expected}: {len(missing)} missing tensors "
            f"{missing[:SHOWN_NAMES]}, {len(unexpected)} unexpected tensors "
            f"{unexpected[:SHOWN_NAMES]}. {advice}"
        )
    for name, layout_name in matched.items():
        tensor, hf_shape = stored[name], layout[layout_name].hf_shape
        if tensor.shape != hf_shape:
            raise ValueError(
                f"Tensor {name!r} in {tensor.file} has shape {tensor.shape}, but config.json "
                f"implies {hf_shape}; the weights and config.json disagree (a different "
                "model's config?)."
            )
    return matched


# ----------------------------------------------------------------------------------------
# Reading and placing
# ----------------------------------------------------------------------------------------


def read_tensors(
    hf_path: str,
    layout: Mapping[str, TensorRule],
    naming: TensorNaming,
    *,
    dtype: Any,
    expected: str,
    advice: str,
) -> Iterator[tuple[Path, np.ndarray]]:
    """(params path, array in `dtype`) for every leaf the checkpoint in `hf_path` fills.

    Every check (`match_tensors`) runs when this is called; the returned iterator then reads
    and converts one stored tensor at a time, so host memory holds one tensor, not the model.
    """
    files = checkpoint_files(hf_path)
    stored = stored_tensors(files)
    matched = match_tensors(
        stored, layout, naming, source=hf_path, expected=expected, advice=advice
    )
    return _converted_tensors(files, stored, matched, layout, np.dtype(dtype))


def _converted_tensors(
    files: list[str],
    stored: Mapping[str, StoredTensor],
    matched: Mapping[str, str],
    layout: Mapping[str, TensorRule],
    dtype: np.dtype,
) -> Iterator[tuple[Path, np.ndarray]]:
    for file in files:
        with safe_open(file, framework="numpy") as f:
            for stored_name, name in matched.items():
                if stored[stored_name].file != file:
                    continue
                rule = layout[name]
                values = rule.to_ours(f.get_tensor(stored_name))
                for path, value in zip(rule.paths, values, strict=True):
                    yield path, np.asarray(value, dtype)


def get_path(tree: Any, path: Path) -> Any:
    """tree[path[0]][path[1]]..."""
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: Path, value: Any) -> None:
    """Sets tree[path[0]][path[1]]... = value, making the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def place_tensors(items: Iterable[tuple[Path, np.ndarray]], shardings: Any = None) -> Params:
    """A params tree of `items`, each put with `jax.device_put` as it arrives.

    `shardings` is a pytree like the params (its leaf at each path is the target);
    None: the default device.
    """
    params: Params = {}
    for path, value in items:
        sharding = None if shardings is None else get_path(shardings, path)
        set_path(params, path, jax.device_put(value, sharding))
    return params
