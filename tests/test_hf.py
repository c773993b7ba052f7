"""Hugging Face import / export (`tba_jax.models.hf`) against transformers itself, and the
command-line tools experiments/compare_hf.py and experiments/export_hf.py.

Every family (llama with llama3 rope scaling, qwen2 tied with qkv bias, gpt_neox
with partial rotary and both residual layouts, gpt2 with Conv1D and learned
positions) is a tiny random transformers model saved to a tmp dir. Weights are
re-drawn after transformers' init (which zeroes biases and sets norms to 1) so a
wrong bias or norm mapping shows up in the logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file
from support import fake_cpu_devices_env

from experiments import compare_hf, export_hf
from tba_jax import mesh as mesh_lib
from tba_jax import runs
from tba_jax.config_lib import ConfigError
from tba_jax.models import (
    PUBLISHED_NUM_PARAMS,
    Model,
    abstract_model,
    hf,
    positions_from_mask,
    preset,
    sequence_scores,
    stack_layers,
)
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARE_SCRIPT = os.path.join(REPO_ROOT, "experiments", "compare_hf.py")
EXPORT_SCRIPT = os.path.join(REPO_ROOT, "experiments", "export_hf.py")
TOL = 1e-4
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FF, MAX_POS = 96, 32, 2, 4, 2, 48, 64
PAD, BOS, EOS = 0, 1, 2
NEW_TOKENS = 20
WEIGHT_STD = 0.2

LM_VARIANTS = ("llama", "qwen2", "gpt_neox", "gpt_neox_sequential", "gpt2")
SCORE_VARIANTS = ("llama_score", "gpt_neox_score", "gpt2_score")
GENERATION_VARIANTS = ("llama", "qwen2", "gpt_neox", "gpt2")
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10_000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # Short enough that the remapping changes the angles at the test's positions.
    original_max_position_embeddings=16,
)


def hf_config(variant: str):
    """The transformers config of a test variant (tiny: 2 layers, hidden 32, vocab 96)."""
    ids = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    llama_like = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        **ids,
    )
    neox = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS,
        **ids,
    )
    gpt2 = dict(
        vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FF, n_layer=LAYERS, n_head=HEADS,
        n_positions=MAX_POS, **ids,
    )  # fmt: skip
    return {
        "llama": lambda: transformers.LlamaConfig(rope_parameters=dict(LLAMA3_ROPE), **llama_like),
        "qwen2": lambda: transformers.Qwen2Config(
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            **llama_like,
        ),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(rotary_pct=0.5, **neox),
        "gpt_neox_sequential": lambda: transformers.GPTNeoXConfig(
            rotary_pct=0.25, use_parallel_residual=False, **neox
        ),
        "gpt2": lambda: transformers.GPT2Config(**gpt2),
        "llama_score": lambda: transformers.LlamaConfig(
            attention_bias=True, mlp_bias=True, num_labels=2, **llama_like
        ),
        "gpt_neox_score": lambda: transformers.GPTNeoXConfig(rotary_pct=0.5, num_labels=1, **neox),
        "gpt2_score": lambda: transformers.GPT2Config(num_labels=1, **gpt2),
    }[variant]()


def randomize(torch_model, seed: int) -> None:
    """Norm scales U(0.5, 1.5); every other weight and bias N(0, WEIGHT_STD)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in torch_model.named_parameters():
            is_norm_scale = param.ndim == 1 and name.endswith("weight")
            if is_norm_scale:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)


class Checkpoint(NamedTuple):
    path: str
    torch_model: object
    model: Model
    params: dict
    apply: object  # jitted model.apply


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """variant -> Checkpoint, each built (and loaded into tba_jax) once per module."""
    built: dict[str, Checkpoint] = {}

    def get(variant: str) -> Checkpoint:
        if variant not in built:
            auto = (
                transformers.AutoModelForSequenceClassification
                if variant.endswith("_score")
                else transformers.AutoModelForCausalLM
            )
            torch_model = auto.from_config(hf_config(variant), attn_implementation="eager")
            # seeded by name: a variant's weights do not depend on which tests ran first
            randomize(torch_model, seed=zlib.crc32(variant.encode()))
            path = str(tmp_path_factory.mktemp(variant))
            torch_model.save_pretrained(path)
            model, params = hf.load_model(path)
            built[variant] = Checkpoint(
                path, torch_model.eval(), model, params, jax.jit(model.apply)
            )
        return built[variant]

    return get


def torch_logits(ckpt: Checkpoint, tokens, mask) -> np.ndarray:
    return compare_hf.torch_outputs(ckpt.torch_model, tokens, mask)


def our_logits(ckpt: Checkpoint, tokens, mask, params=None) -> np.ndarray:
    params = ckpt.params if params is None else params
    logits, _ = ckpt.apply(params, tokens, positions_from_mask(mask), mask)
    return np.asarray(logits)


def padded_batch(seed: int = 0, width: int = 12, batch: int = 4, side: str = "left"):
    """tokens [B, S] int32 (PAD on padding), mask [B, S] bool; rows of different lengths."""
    tokens, mask = compare_hf.left_padded_batch(VOCAB, batch, width, seed)
    if side == "right":  # move each row's padding to its end, tokens kept in order
        pads = (~mask).sum(axis=1)
        tokens = np.stack([np.roll(row, -pad) for row, pad in zip(tokens, pads, strict=True)])
        mask = np.stack([np.roll(row, -pad) for row, pad in zip(mask, pads, strict=True)])
    return tokens, mask


def real_outputs(outputs: np.ndarray, mask: np.ndarray, head: str) -> np.ndarray:
    """Logits at real slots ([N, V]) for a causal LM; pooled scores as they are."""
    return outputs[mask] if head == "lm" else outputs


def stored_tensors(directory: str) -> dict[str, np.ndarray]:
    tensors = {}
    for path in hf.checkpoint_files(directory):
        with safe_open(path, framework="numpy") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return tensors


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


# ----------------------------------------------------------------------------------------
# 1. Logits against transformers.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", LM_VARIANTS)
def test_logits_match_transformers_with_left_padding(checkpoint, variant):
    ckpt = checkpoint(variant)
    assert ckpt.model.config.family == variant.removesuffix("_sequential")
    tokens, mask = padded_batch()
    assert (~mask).any() and mask[0].all()
    expected = torch_logits(ckpt, tokens, mask)
    assert expected[mask].std() > 0.5  # far from flat: 1e-4 agreement means something
    np.testing.assert_allclose(our_logits(ckpt, tokens, mask)[mask], expected[mask], atol=TOL)


def test_imported_switches_per_family(checkpoint):
    llama = checkpoint("llama").model.config
    assert (llama.rope_scaling, llama.rope_scaling_factor, llama.rope_original_max_len) == (
        "llama3",
        8.0,
        16,
    )
    qwen = checkpoint("qwen2").model.config
    assert qwen.tie_embeddings and qwen.qkv_bias and not qwen.attn_out_bias
    assert "lm_head" not in checkpoint("qwen2").params
    assert qwen.rope_theta == 1e6
    neox = checkpoint("gpt_neox").model.config
    assert (neox.rotary_pct, neox.rotary_dim, neox.parallel_residual) == (0.5, 4, True)
    assert not checkpoint("gpt_neox_sequential").model.config.parallel_residual
    gpt2 = checkpoint("gpt2").model.config
    assert (gpt2.position_embedding, gpt2.activation, gpt2.tie_embeddings) == (
        "learned",
        "gelu_new",
        True,
    )
    assert checkpoint("gpt2").params["position_embedding"].shape == (MAX_POS, HIDDEN)


@pytest.mark.parametrize(
    "variant, wrong",
    [
        ("llama", dict(rope_scaling=None)),
        ("gpt_neox", dict(rotary_pct=1.0)),
        ("gpt_neox_sequential", dict(parallel_residual=True)),
    ],
)
def test_the_comparison_has_teeth(checkpoint, variant, wrong):
    """Switching off llama3 scaling, partial rotary or the residual layout breaks agreement."""
    ckpt = checkpoint(variant)
    model, _ = abstract_model(hf.config_from_hf(ckpt.path, **wrong))
    tokens, mask = padded_batch()
    logits, _ = jax.jit(model.apply)(ckpt.params, tokens, positions_from_mask(mask), mask)
    diff = np.abs(np.asarray(logits) - torch_logits(ckpt, tokens, mask))[mask]
    assert diff.max() > 100 * TOL


# ----------------------------------------------------------------------------------------
# 2. Greedy generation (prefill + KV cache) against transformers' generate.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", GENERATION_VARIANTS)
def test_greedy_generation_matches_transformers(checkpoint, variant):
    ckpt = checkpoint(variant)
    prompt_width = 6
    tokens, mask = compare_hf.left_padded_batch(VOCAB, 3, prompt_width, seed=3)
    # EOS = VOCAB is never produced, so neither side stops early.
    generate = make_generate_fn(
        ckpt.model, SamplingConfig(max_new_tokens=NEW_TOKENS, greedy=True), eos_id=VOCAB, pad_id=PAD
    )
    ours = np.asarray(generate(ckpt.params, tokens, mask, jax.random.key(0)).tokens)
    with torch.no_grad():
        out = ckpt.torch_model.generate(
            input_ids=torch.from_numpy(tokens.astype(np.int64)),
            attention_mask=torch.from_numpy(mask.astype(np.int64)),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=VOCAB,
        )
    theirs = out[:, prompt_width:].numpy()
    assert theirs.shape == (3, NEW_TOKENS)
    assert len(np.unique(theirs)) > 5  # not a degenerate repeat of one token
    np.testing.assert_array_equal(ours, theirs)


# ----------------------------------------------------------------------------------------
# 3. Export: save_hf -> from_pretrained.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, max_shard_bytes",
    [
        ("llama", hf.DEFAULT_MAX_SHARD_BYTES),
        ("qwen2", hf.DEFAULT_MAX_SHARD_BYTES),
        ("gpt_neox", 20_000),
        ("gpt_neox_sequential", hf.DEFAULT_MAX_SHARD_BYTES),
        ("gpt2", 20_000),
        ("llama_score", hf.DEFAULT_MAX_SHARD_BYTES),
        ("gpt_neox_score", hf.DEFAULT_MAX_SHARD_BYTES),
    ],
)
def test_export_loads_in_transformers_with_same_logits(
    checkpoint, tmp_path, variant, max_shard_bytes
):
    ckpt = checkpoint(variant)
    out = str(tmp_path / "export")
    # Token ids are the tokenizer's business, not ModelConfig's: passed through.
    token_ids = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    files = hf.save_hf(
        out,
        ckpt.model.config,
        ckpt.params,
        max_shard_bytes=max_shard_bytes,
        hf_config_overrides=token_ids,
    )
    assert read_json(os.path.join(out, "config.json"))["pad_token_id"] == PAD
    sharded = max_shard_bytes < hf.DEFAULT_MAX_SHARD_BYTES
    assert os.path.exists(os.path.join(out, hf.INDEX_FILENAME)) == sharded
    weight_files = sum(name.endswith(".safetensors") for name in files)
    assert weight_files > 1 if sharded else weight_files == 1
    # every file readable as the user's umask makes new files (not safetensors' own 0600)
    modes = {stat.S_IMODE(os.stat(path).st_mode) for path in files}
    assert modes == {stat.S_IMODE(os.stat(os.path.join(out, "config.json")).st_mode)}

    # Tensor for tensor what transformers itself wrote: names, shapes, dtypes, values.
    original, exported = stored_tensors(ckpt.path), stored_tensors(out)
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype
        np.testing.assert_array_equal(exported[name], value, err_msg=name)

    auto = type(ckpt.torch_model)
    reloaded, info = auto.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert [type(reloaded).__name__] == read_json(os.path.join(out, "config.json"))["architectures"]
    tokens, mask = padded_batch(seed=4)
    head = ckpt.model.config.head
    np.testing.assert_allclose(
        real_outputs(compare_hf.torch_outputs(reloaded.eval(), tokens, mask), mask, head),
        real_outputs(torch_logits(ckpt, tokens, mask), mask, head),
        atol=TOL,
    )


def test_export_in_bfloat16(checkpoint, tmp_path):
    ckpt = checkpoint("qwen2")
    out = str(tmp_path / "bf16")
    hf.save_hf(out, ckpt.model.config, ckpt.params, dtype="bfloat16")
    assert read_json(os.path.join(out, "config.json"))["dtype"] == "bfloat16"
    stored = stored_tensors(out)
    assert {value.dtype.name for value in stored.values()} == {"bfloat16"}
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"])
    assert next(reloaded.parameters()).dtype == torch.bfloat16


def test_scanned_layers_load_and_export_like_the_per_layer_model(checkpoint, tmp_path):
    """With scan_layers the block tensors of a sharded checkpoint (a layer's tensors in
    several files) are stacked on import, give transformers' logits, and export back to
    the very tensors transformers wrote."""
    ckpt = checkpoint("gpt_neox")  # fused qkv (one tensor -> three leaves), biases
    sharded = str(tmp_path / "sharded")
    ckpt.torch_model.save_pretrained(sharded, max_shard_size="20KB")
    cfg = dataclasses.replace(ckpt.model.config, scan_layers=True)
    model, _ = abstract_model(cfg)
    params = hf.load_params(sharded, model)
    assert_trees_equal(params, stack_layers(ckpt.params))
    tokens, mask = padded_batch()
    logits, _ = jax.jit(model.apply)(params, tokens, positions_from_mask(mask), mask)
    expected = torch_logits(ckpt, tokens, mask)
    np.testing.assert_allclose(np.asarray(logits)[mask], expected[mask], atol=TOL)
    out = str(tmp_path / "export")
    hf.save_hf(out, cfg, params, max_shard_bytes=20_000)
    original, exported = stored_tensors(ckpt.path), stored_tensors(out)
    assert sorted(exported) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


# ----------------------------------------------------------------------------------------
# 4. Sharded checkpoints, dtypes and target shardings on import.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["gpt_neox", "gpt2"])
def test_sharded_checkpoint_loads_like_the_single_file(checkpoint, tmp_path, variant):
    ckpt = checkpoint(variant)
    ckpt.torch_model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    with open(tmp_path / hf.INDEX_FILENAME) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    assert not (tmp_path / hf.SINGLE_WEIGHTS_FILENAME).exists()
    assert_trees_equal(hf.load_params(str(tmp_path), ckpt.model), ckpt.params)


def test_bfloat16_import_both_ways(checkpoint, tmp_path):
    ckpt = checkpoint("gpt_neox")
    # float32 checkpoint -> bfloat16 params (and bfloat16 compute).
    model, params = hf.load_model(ckpt.path, dtype="bfloat16")
    assert model.config.param_dtype == model.config.dtype == "bfloat16"
    assert_trees_equal(params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), ckpt.params))
    # bfloat16 checkpoint (written by transformers) -> float32 params.
    type(ckpt.torch_model).from_pretrained(ckpt.path, dtype=torch.bfloat16).save_pretrained(
        str(tmp_path)
    )
    assert {v.dtype.name for v in stored_tensors(str(tmp_path)).values()} == {"bfloat16"}
    widened = hf.load_params(str(tmp_path), ckpt.model)
    assert_trees_equal(widened, jax.tree.map(lambda x: x.astype(jnp.float32), params))


def test_params_land_on_the_requested_shardings(checkpoint):
    ckpt = checkpoint("llama")
    mesh = mesh_lib.make_mesh(jax.devices()[:1], {})
    rules = [("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor")]

    def shardings_fn(model, abstract):
        return mesh_lib.param_shardings(model.logical_axes, abstract, mesh, rules)

    model, params = hf.load_model(ckpt.path, shardings_fn=shardings_fn)
    expected = shardings_fn(model, abstract_model(model.config)[1])
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding == sharding
    assert_trees_equal(params, ckpt.params)


MULTI_DEVICE_SCRIPT = """
import json, sys, jax, numpy as np
from experiments import compare_hf
from tba_jax import mesh as mesh_lib
from tba_jax.models import hf
mesh = mesh_lib.make_mesh(jax.devices(), {"fsdp": 2})
rules = [("embed", "fsdp")]
fn = lambda model, abstract: mesh_lib.param_shardings(model.logical_axes, abstract, mesh, rules)
model, placed = hf.load_model(sys.argv[1], shardings_fn=fn)
_, single = hf.load_model(sys.argv[1])
wq = placed["blocks"][0]["attn"]["wq"]
print(json.dumps({
    "spec": [a for a in wq.sharding.spec],
    "shards": len(wq.addressable_shards),
    "shard_rows": wq.addressable_shards[0].data.shape[0],
    "equal": all(np.array_equal(a, b) for a, b in
                 zip(jax.tree.leaves(placed), jax.tree.leaves(single))),
}))
"""


def test_params_split_over_two_fake_devices(checkpoint):
    ckpt = checkpoint("gpt_neox")
    env = fake_cpu_devices_env(2)
    result = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE_SCRIPT, ckpt.path],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {
        "spec": ["fsdp", None, None],
        "shards": 2,
        "shard_rows": HIDDEN // 2,
        "equal": True,
    }


# ----------------------------------------------------------------------------------------
# 5. Reward models: *ForSequenceClassification.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", SCORE_VARIANTS)
@pytest.mark.parametrize("padding", ["left", "right"])
def test_sequence_scores_match_transformers(checkpoint, variant, padding):
    ckpt = checkpoint(variant)
    cfg = ckpt.model.config
    assert cfg.head == "score" and "lm_head" not in ckpt.params
    assert cfg.num_labels == ckpt.torch_model.config.num_labels
    tokens, mask = padded_batch(seed=5, side=padding)
    assert (~mask[:, -1]).any() if padding == "right" else (~mask[:, 0]).any()
    ours = np.asarray(sequence_scores(ckpt.model, ckpt.params, tokens, mask))
    expected = torch_logits(ckpt, tokens, mask)
    assert ours.shape == expected.shape == (tokens.shape[0], cfg.num_labels)
    assert expected.std() > 0.1
    np.testing.assert_allclose(ours, expected, atol=TOL)


def test_compare_handles_classifiers(checkpoint):
    summary = compare_hf.compare(checkpoint("llama_score").path)
    assert (summary["family"], summary["head"]) == ("llama", "score")
    assert summary["max_abs_logit_diff"] <= TOL


def test_sequence_scores_needs_a_score_head(checkpoint):
    ckpt = checkpoint("llama")
    tokens, mask = padded_batch()
    with pytest.raises(ValueError, match="head='score'"):
        sequence_scores(ckpt.model, ckpt.params, tokens, mask)


# ----------------------------------------------------------------------------------------
# 6. The CLI.
# ----------------------------------------------------------------------------------------


def test_compare_cli_prints_a_json_last_line(checkpoint):
    ckpt = checkpoint("gpt_neox")
    result = subprocess.run(
        [sys.executable, COMPARE_SCRIPT, f"--hf_path={ckpt.path}"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["family"] == "gpt_neox"
    assert 0.0 <= summary["max_abs_logit_diff"] <= TOL
    assert "Loading weights" not in result.stderr  # no transformers progress bar


# experiments/export_hf.py as a script, with the run reading (tba_jax.runs) replaced: the
# "trained policy" is the checkpoint folder's own weights.
EXPORT_CLI_SCRIPT = """
import runpy, sys
import ml_collections
import tba_jax.runs
from tba_jax.models import hf
from tba_jax.models.tokenizers import CharTokenizer

hf_path, script, *argv = sys.argv[1:]

def fake_restore_run(config, workdir, step=None):
    print(f"restore_run({workdir!r}, {step!r})", file=sys.stderr)
    model, params = hf.load_model(hf_path)
    return tba_jax.runs.RestoredRun(model, params, params, {}, 7 if step is None else step)

tba_jax.runs.restore_run = fake_restore_run
# A run from a preset (no model.hf_path) with the char tokenizer of its task.
tba_jax.runs.load_config = lambda workdir: ml_collections.ConfigDict({"model": {"hf_path": ""}})
tba_jax.runs.run_tokenizer = lambda config, workdir: CharTokenizer.for_arithmetic()
sys.argv = [script, *argv]
runpy.run_path(script, run_name="__main__")
"""


def test_export_cli_writes_the_trained_policy(checkpoint, tmp_path):
    ckpt = checkpoint("llama")
    out = str(tmp_path / "exported")
    argv = ["--workdir=/some/run", f"--out={out}", '--hf_config_overrides={"eos_token_id": 2}']
    result = subprocess.run(
        [sys.executable, "-c", EXPORT_CLI_SCRIPT, ckpt.path, EXPORT_SCRIPT, *argv],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restore_run('/some/run', None)" in result.stderr
    assert read_json(os.path.join(out, "config.json"))["eos_token_id"] == 2
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["step"] == 7  # the latest, as the (fake) checkpoint read says
    assert summary["family"] == "llama" and "model.safetensors" in summary["files"]
    assert "tokenizer.json" in summary["files"]
    assert_trees_equal(hf.load_params(out, ckpt.model), ckpt.params)
    again = subprocess.run(
        [sys.executable, "-c", EXPORT_CLI_SCRIPT, ckpt.path, EXPORT_SCRIPT, *argv, "--overwrite"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, again.stderr[-3000:]  # --overwrite: into a non-empty --out


def test_export_cli_rejects_overrides_that_are_not_a_json_object(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            EXPORT_SCRIPT,
            f"--workdir={tmp_path}",
            f"--out={tmp_path / 'out'}",
            "--hf_config_overrides=[2]",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: --hf_config_overrides=[2]")


# export_hf.export_run with the run reading (tba_jax.runs) replaced, as above, in this process.


class FakeRun(NamedTuple):
    workdir: str
    folders: dict  # config key -> the checkpoint folder it names (a copy of the llama one)
    restored: list  # the steps a trained policy was restored for


@pytest.fixture
def fake_run(checkpoint, tmp_path, monkeypatch):
    """A run started from a copy of the llama checkpoint, with another copy as π_ref; its
    "trained policy" is the checkpoint's weights."""
    ckpt = checkpoint("llama")
    folders = {}
    for key in ("model.hf_path", "reference.hf_path"):
        folders[key] = str(tmp_path / key.split(".")[0])
        shutil.copytree(ckpt.path, folders[key])
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = ml_collections.ConfigDict(
        {key.split(".")[0]: {"hf_path": folder} for key, folder in folders.items()}
    )
    restored = []

    def restore_run(config, workdir, step=None):
        restored.append(step)
        return runs.RestoredRun(ckpt.model, ckpt.params, ckpt.params, {}, step or 1)

    monkeypatch.setattr(runs, "load_config", lambda workdir: config)
    monkeypatch.setattr(runs, "restore_run", restore_run)
    return FakeRun(str(workdir), folders, restored)


def folder_contents(folder: str) -> dict[str, bytes | None]:
    """Name -> bytes of each entry of `folder` (None for a subfolder)."""
    entries = pathlib.Path(folder).iterdir()
    return {path.name: None if path.is_dir() else path.read_bytes() for path in entries}


@pytest.mark.parametrize("target", ["model.hf_path", "reference.hf_path", "workdir"])
@pytest.mark.parametrize("through_a_link", [False, True])
def test_export_refuses_the_runs_own_folders(fake_run, tmp_path, target, through_a_link):
    folder = fake_run.workdir if target == "workdir" else fake_run.folders[target]
    out = folder
    if through_a_link:
        out = str(tmp_path / "link")
        os.symlink(folder, out)
    before = folder_contents(folder)
    refused = pytest.raises(ConfigError, match=rf"--out={out} is the run's {target}")
    with refused:
        export_hf.export_run(fake_run.workdir, out)
    with refused:  # not even with overwrite
        export_hf.export_run(fake_run.workdir, out, overwrite=True)
    assert fake_run.restored == []  # refused before any checkpoint is read
    assert folder_contents(folder) == before


def test_export_into_a_non_empty_folder_needs_overwrite(checkpoint, fake_run, tmp_path):
    """An earlier sharded export is replaced by a single-file one: with --overwrite its
    shards and index are gone (loaders would read the stale index), other files stay."""
    ckpt = checkpoint("llama")
    out = tmp_path / "exported"
    hf.save_hf(str(out), ckpt.model.config, ckpt.params, max_shard_bytes=20_000)
    assert (out / hf.INDEX_FILENAME).exists()
    (out / "README.md").write_text("notes")
    (out / "logs").mkdir()
    before = folder_contents(str(out))
    with pytest.raises(ConfigError, match=r"is not empty.*--overwrite"):
        export_hf.export_run(fake_run.workdir, str(out))
    assert fake_run.restored == [] and folder_contents(str(out)) == before

    summary = export_hf.export_run(fake_run.workdir, str(out), overwrite=True)
    assert sorted(os.listdir(out)) == sorted([*summary["files"], "README.md", "logs"])
    assert hf.SINGLE_WEIGHTS_FILENAME in summary["files"]
    assert (out / "README.md").read_text() == "notes"
    assert_trees_equal(hf.load_params(str(out), ckpt.model), ckpt.params)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])


@pytest.mark.parametrize("overwrite", [False, True])
def test_export_refuses_a_file_as_out(fake_run, tmp_path, overwrite):
    out = tmp_path / "model.safetensors"
    out.write_text("not a folder")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        export_hf.export_run(fake_run.workdir, str(out), overwrite=overwrite)
    assert fake_run.restored == [] and out.read_text() == "not a folder"


# ----------------------------------------------------------------------------------------
# 7. config.json layouts.
# ----------------------------------------------------------------------------------------


def test_neox_config_old_and_new_rotary_layouts(checkpoint):
    new = hf.read_hf_config(checkpoint("gpt_neox").path)
    # transformers 5.23 writes rope_parameters with partial_rotary_factor.
    assert new["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert "rotary_pct" not in new
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rotary_pct=0.5, rotary_emb_base=10_000)
    assert hf.config_from_hf_dict(old) == hf.config_from_hf_dict(new)
    # Absent entirely: GPT-NeoX's default rotary_pct is 0.25.
    bare = {k: v for k, v in new.items() if k != "rope_parameters"}
    assert hf.config_from_hf_dict(bare).rotary_pct == 0.25


def test_llama_config_old_rope_scaling_layout(checkpoint):
    new = hf.read_hf_config(checkpoint("llama").path)
    scaling = {k: v for k, v in new["rope_parameters"].items() if k not in ("rope_theta",)}
    scaling["type"] = scaling.pop("rope_type")  # transformers 4.3x spelling
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=10_000.0, rope_scaling=scaling)
    assert hf.config_from_hf_dict(old) == hf.config_from_hf_dict(new)


def test_config_round_trips_through_transformers(checkpoint):
    for variant in LM_VARIANTS + SCORE_VARIANTS:
        cfg = checkpoint(variant).model.config
        written = hf.config_to_hf(cfg)
        assert hf.config_from_hf_dict(written) == cfg
        # transformers parses what we write back to the same numbers.
        reparsed = transformers.AutoConfig.for_model(**written).to_dict()
        assert hf.config_from_hf_dict(reparsed) == cfg, variant


# Key fields of the public checkpoints' config.json files (transformers 4.x layouts).
HUB_CONFIGS = {
    "rho-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, hidden_act="silu",
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_scaling=None,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "pythia-410m": dict(
        architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", vocab_size=50304,
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16, hidden_act="gelu", layer_norm_eps=1e-5,
        max_position_embeddings=2048, rotary_emb_base=10000, rotary_pct=0.25,
        tie_word_embeddings=False, use_parallel_residual=True,
    ),
    "gpt2": dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=50257,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, n_ctx=1024, n_embd=768,
        n_head=12, n_layer=12, n_positions=1024,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        attention_bias=False, head_dim=64, hidden_act="silu", hidden_size=2048,
        intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False,
        num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(
            factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
            original_max_position_embeddings=8192, rope_type="llama3",
        ),
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
        hidden_act="silu", hidden_size=896, intermediate_size=4864,
        max_position_embeddings=32768, num_attention_heads=14, num_hidden_layers=24,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        sliding_window=32768, tie_word_embeddings=True, use_sliding_window=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HUB_CONFIGS))
def test_presets_equal_the_public_checkpoint_configs(name):
    assert hf.config_from_hf_dict(HUB_CONFIGS[name]) == preset(name)


# ----------------------------------------------------------------------------------------
# 8. Presets: published parameter counts, also as counted by transformers.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED_NUM_PARAMS))
def test_preset_num_params_equal_published_counts(name):
    cfg = preset(name)
    assert cfg.num_params() == PUBLISHED_NUM_PARAMS[name]
    if name == "llama-1b":
        return  # a size preset of this repo, not tied to a transformers family export
    hf_cfg = transformers.AutoConfig.for_model(**hf.config_to_hf(cfg))
    with torch.device("meta"):  # shapes only, nothing allocated
        torch_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    assert sum(p.numel() for p in torch_model.parameters()) == PUBLISHED_NUM_PARAMS[name]


# ----------------------------------------------------------------------------------------
# 9. Bad input.
# ----------------------------------------------------------------------------------------


def copy_checkpoint(ckpt: Checkpoint, tmp_path) -> str:
    path = str(tmp_path / "copy")
    shutil.copytree(ckpt.path, path)
    return path


def rewrite_weights(path: str, edit) -> None:
    weights = os.path.join(path, hf.SINGLE_WEIGHTS_FILENAME)
    tensors = stored_tensors(path)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_unsupported_model_type(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}, f)
    with pytest.raises(ValueError, match=r"'mamba'.*not supported.*llama.*qwen2.*gpt_neox.*gpt2"):
        hf.config_from_hf(str(tmp_path))


def test_unsupported_rope_type(checkpoint):
    config = hf.read_hf_config(checkpoint("llama").path)
    config["rope_parameters"] = dict(rope_type="yarn", rope_theta=1e4, factor=4.0)
    with pytest.raises(ValueError, match=r"rope_type 'yarn'.*default.*llama3"):
        hf.config_from_hf_dict(config)


def test_missing_config_and_weight_files(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        hf.config_from_hf(str(tmp_path))
    shutil.copy(os.path.join(checkpoint("gpt2").path, "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError, match=r"No \*\.safetensors weights"):
        hf.load_model(str(tmp_path))


def test_missing_shard(checkpoint, tmp_path):
    checkpoint("gpt2").torch_model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    os.remove(sorted(tmp_path.glob("model-*.safetensors"))[-1])
    with pytest.raises(FileNotFoundError, match="shards that are missing"):
        hf.load_model(str(tmp_path))


def test_weight_of_the_wrong_shape(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("gpt_neox"), tmp_path)
    name = "gpt_neox.layers.1.attention.query_key_value.weight"
    rewrite_weights(path, lambda t: t.update({name: t[name][:-4]}))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(92, 32\).*\(96, 32\)"):
        hf.load_model(path)


def test_missing_and_unexpected_tensors(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("llama"), tmp_path)
    missing = "model.layers.1.mlp.up_proj.weight"

    def edit(tensors):
        del tensors[missing]
        tensors["model.layers.7.mlp.extra.weight"] = np.zeros(3, np.float32)

    rewrite_weights(path, edit)
    with pytest.raises(
        ValueError, match=r"1 missing.*up_proj.*1 unexpected.*layers\.7\.mlp\.extra"
    ):
        hf.load_model(path)


def test_bare_base_model_names_tied_head_copies_and_buffers_load_the_same(checkpoint, tmp_path):
    """Stored names without the base-model prefix, a stored copy of a tied output embedding
    and a causal-mask buffer (as older GPT-2 checkpoints have) load like the original."""
    ckpt = checkpoint("gpt2")
    path = copy_checkpoint(ckpt, tmp_path)

    def edit(tensors):
        bare = {name.removeprefix("transformer."): value for name, value in tensors.items()}
        assert len(bare) == len(tensors) and "wte.weight" in bare
        bare["lm_head.weight"] = bare["wte.weight"].copy()
        bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, MAX_POS, MAX_POS), np.float32))
        tensors.clear()
        tensors.update(bare)

    rewrite_weights(path, edit)
    assert_trees_equal(hf.load_params(path, ckpt.model), ckpt.params)


def test_export_refuses_a_config_its_family_cannot_express(checkpoint, tmp_path):
    ckpt = checkpoint("qwen2")
    no_bias = dataclasses.replace(ckpt.model.config, qkv_bias=False)
    _, params = abstract_model(no_bias)
    with pytest.raises(ValueError, match="qkv_bias=False"):
        hf.save_hf(str(tmp_path), no_bias, params)


def test_export_refuses_params_of_another_config(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="params do not match the model config"):
        hf.save_hf(str(tmp_path), checkpoint("llama").model.config, checkpoint("qwen2").params)
