"""Hugging Face checkpoints of the decoder families: import and export.

Import reads a transformers checkpoint directory (config.json plus one or several
`*.safetensors` files) with NumPy only, converts each tensor to this package's layout and
places it straight onto its target sharding, one tensor at a time (`hf_checkpoint` reads,
`hf_layout` names the tensors, `hf_config` converts config.json). Export writes a directory
`transformers.AutoModelForCausalLM` (or `AutoModelForSequenceClassification`) loads with no
missing or unexpected keys, with the source folder's tokenizer files when asked.

Supported model types: llama, qwen2, gpt_neox, gpt2; causal-LM checkpoints and
`*ForSequenceClassification` ones (a `score` head, see `ModelConfig.head`). The command-line
tools are experiments/compare_hf.py (logits against transformers) and
experiments/export_hf.py (a training run's policy).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from tba_jax.models import Model, Params, abstract_model
from tba_jax.models.config import DTYPES, ModelConfig
from tba_jax.models.hf_checkpoint import (
    CONFIG_FILENAME,
    INDEX_FILENAME,
    SHOWN_NAMES,
    SINGLE_WEIGHTS_FILENAME,
    Path,
    checkpoint_files,
    get_path,
    place_tensors,
    read_hf_config,
    read_tensors,
)
from tba_jax.models.hf_config import config_from_hf, config_from_hf_dict, config_to_hf
from tba_jax.models.hf_layout import tensor_naming, weight_layout

__all__ = [
    "CONFIG_FILENAME",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILENAME",
    "SINGLE_WEIGHTS_FILENAME",
    "checkpoint_files",
    "config_from_hf",
    "config_from_hf_dict",
    "config_to_hf",
    "copy_tokenizer_files",
    "export_files_in",
    "load_model",
    "load_params",
    "read_hf_config",
    "remove_export_files",
    "save_hf",
    "token_ids_of",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size ("5GB")
BLOCKS = "blocks"  # the params entry holding the decoder's layers


# ----------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------


def load_params(hf_path: str, model: Model, *, shardings: Any = None, dtype: Any = None) -> Params:
    """Reads the checkpoint in `hf_path` into params for `model`.

    Each tensor is read (NumPy, no torch), converted to this package's layout and
    dtype (`dtype`, default the model's param_dtype) and placed with
    `jax.device_put` onto its entry of `shardings` (a pytree like the params; None:
    the default device), one tensor at a time. Raises if a tensor is missing,
    unexpected or of the wrong shape, before any data is read. With `scan_layers` each
    block tensor is stacked over the layers on the host and placed once all its layers
    are read (the host then holds up to one copy of the blocks' weights).
    """
    cfg = model.config
    tensors = read_tensors(
        hf_path,
        weight_layout(cfg),
        tensor_naming(cfg),
        dtype=cfg.storage_dtype if dtype is None else _jnp_dtype(dtype),
        expected=(
            f"its {cfg.family} config (head={cfg.head!r}, tie_embeddings={cfg.tie_embeddings})"
        ),
        advice="Check config.json against the weights (a different model's checkpoint?).",
    )
    if cfg.scan_layers:
        tensors = stacked_blocks(tensors, cfg.num_layers)
    return place_tensors(tensors, shardings)


def stacked_blocks(
    tensors: Iterable[tuple[Path, np.ndarray]], num_layers: int
) -> Iterator[tuple[Path, np.ndarray]]:
    """`tensors` (params path, array) with the per-layer block leaves (paths ("blocks",
    i, ...)) gathered into the `scan_layers` layout: one ("blocks", ...) array of shape
    [num_layers, ...] per leaf, yielded once all its layers have arrived. Other leaves
    pass through as they come."""
    pending: dict[Path, dict[int, np.ndarray]] = {}
    for path, value in tensors:
        if path[0] != BLOCKS:
            yield path, value
            continue
        stacked_path = (BLOCKS, *path[2:])
        layers = pending.setdefault(stacked_path, {})
        layers[path[1]] = value
        if len(layers) == num_layers:
            yield stacked_path, np.stack([layers[index] for index in range(num_layers)])
            del pending[stacked_path]


def layout_leaf(params: Params, path: Path, scan_layers: bool) -> Any:
    """The leaf of `params` that per-layer `path` (a layout rule's) names: with
    `scan_layers`, layer path[1] of the stacked leaf ("blocks", ...)."""
    if scan_layers and path[0] == BLOCKS:
        return get_path(params, (BLOCKS, *path[2:]))[path[1]]
    return get_path(params, path)


def load_model(
    hf_path: str,
    *,
    dtype: Any = None,
    shardings_fn: Callable[[Model, Params], Any] | None = None,
) -> tuple[Model, Params]:
    """The model and params of the checkpoint in `hf_path`.

    `dtype` (e.g. "bfloat16") sets both param and compute dtypes (default
    float32). `shardings_fn(model, abstract_params)` returns the params'
    shardings (e.g. from `tba_jax.mesh.param_shardings`); None: default device.
    """
    overrides = {}
    if dtype is not None:
        name = _dtype_name(dtype)
        overrides = dict(dtype=name, param_dtype=name)
    cfg = config_from_hf(hf_path, **overrides)
    model, abstract = abstract_model(cfg)
    shardings = None if shardings_fn is None else shardings_fn(model, abstract)
    return model, load_params(hf_path, model, shardings=shardings)


def _jnp_dtype(dtype: Any):
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}.")
        return dtype
    for name, value in DTYPES.items():
        if np.dtype(value) == np.dtype(dtype):
            return name
    raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPES)}.")


# ----------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Groups tensor names, in order, into shards of at most max_shard_bytes (a tensor
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _flat_shapes(tree: Params) -> dict[tuple, tuple[int, ...]]:
    """Path -> shape of every leaf of a params tree (arrays or ShapeDtypeStructs)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def _check_param_shapes(cfg: ModelConfig, params: Params) -> None:
    expected = _flat_shapes(abstract_model(cfg)[1])
    actual = _flat_shapes(params)
    if expected.keys() != actual.keys():
        extra, absent = (
            sorted(actual.keys() - expected.keys()),
            sorted(expected.keys() - actual.keys()),
        )
        raise ValueError(
            f"params do not match the model config: missing {absent[:SHOWN_NAMES]}, "
            f"unexpected {extra[:SHOWN_NAMES]}; pass the config the params were made with."
        )
    wrong = [
        (path, actual[path], shape) for path, shape in expected.items() if actual[path] != shape
    ]
    if wrong:
        raise ValueError(
            "params do not match the model config: (path, shape, expected) "
            f"{wrong[:SHOWN_NAMES]}; pass the config the params were made with."
        )


def save_hf(
    out_dir: str,
    model_cfg: ModelConfig,
    params: Params,
    *,
    dtype: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    hf_config_overrides: dict[str, Any] | None = None,
) -> list[str]:
    """Writes `params` as a transformers checkpoint: config.json plus model.safetensors,
    or `model-0000k-of-0000n.safetensors` shards and their index when the weights
    exceed `max_shard_bytes`. `dtype` (default the config's param_dtype) is the stored
    dtype; `hf_config_overrides` adds config.json keys (e.g. eos_token_id,
    pad_token_id). Host memory holds one shard at a time. Returns the files written.
    """
    _check_param_shapes(model_cfg, params)
    name = _dtype_name(model_cfg.param_dtype if dtype is None else dtype)
    target = np.dtype(DTYPES[name])
    layout = weight_layout(model_cfg)
    sizes = {key: math.prod(rule.hf_shape) * target.itemsize for key, rule in layout.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    os.makedirs(out_dir, exist_ok=True)
    filenames = (
        [SINGLE_WEIGHTS_FILENAME]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    for filename, shard in zip(filenames, shards, strict=True):
        tensors = {}
        for key in shard:
            rule = layout[key]
            ours = [
                np.asarray(jax.device_get(layout_leaf(params, path, model_cfg.scan_layers)))
                for path in rule.paths
            ]
            tensors[key] = np.ascontiguousarray(rule.to_hf(*ours).astype(target))
        save_file(tensors, os.path.join(out_dir, filename), metadata={"format": "pt"})
    written = [os.path.join(out_dir, filename) for filename in filenames]
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": {
                key: filename
                for filename, shard in zip(filenames, shards, strict=True)
                for key in shard
            },
        }
        written.append(_write_json(os.path.join(out_dir, INDEX_FILENAME), index))
    hf_config = {**config_to_hf(model_cfg, dtype=name), **(hf_config_overrides or {})}
    config_path = _write_json(os.path.join(out_dir, CONFIG_FILENAME), hf_config)
    # safetensors writes through a private temporary file (mode 0600): the weights get the
    # mode a new file gets under the user's umask, as config.json has
    mode = stat.S_IMODE(os.stat(config_path).st_mode)
    for filename in filenames:
        os.chmod(os.path.join(out_dir, filename), mode)
    return [*written, config_path]


def _write_json(path: str, value: Any) -> str:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


# ----------------------------------------------------------------------------------------
# Tokenizer files and token ids carried over from a source folder
# ----------------------------------------------------------------------------------------

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# What an export writes, and what a loader would read next to it: the weights (single or
# sharded, any shard count), their index, config.json and the tokenizer files.
EXPORT_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    CONFIG_FILENAME,
    *TOKENIZER_FILES,
)


def export_files_in(folder: str) -> list[str]:
    """The files in `folder` (not in its subfolders) an export writes or a loader would read
    with it (EXPORT_FILE_PATTERNS), sorted; [] for a folder that does not exist."""
    if not os.path.isdir(folder):
        return []
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, name))
        and any(fnmatch.fnmatch(name, pattern) for pattern in EXPORT_FILE_PATTERNS)
    )


def remove_export_files(folder: str) -> list[str]:
    """Removes an earlier export's files from `folder` (`export_files_in`), so none of them
    (e.g. an old shard index) is read with a new export; the folder and its other files
    stay. Returns the paths removed."""
    removed = export_files_in(folder)
    for path in removed:
        os.remove(path)
    return removed


def token_ids_of(hf_path: str) -> dict[str, Any]:
    """The special-token ids in `hf_path`'s config.json (those that are set), for an export's
    `hf_config_overrides`."""
    source_config = read_hf_config(hf_path)
    return {key: source_config[key] for key in TOKEN_ID_KEYS if source_config.get(key) is not None}


def copy_tokenizer_files(hf_path: str, out: str) -> list[str]:
    """Copies the tokenizer files of `hf_path` that exist (TOKENIZER_FILES) into `out`;
    returns the paths written."""
    copied = []
    for name in TOKENIZER_FILES:
        source = os.path.join(hf_path, name)
        if os.path.exists(source):
            copied.append(shutil.copy(source, os.path.join(out, name)))
    return copied
