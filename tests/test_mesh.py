"""Device split, meshes, logical-axis shardings and publishing (`tba_jax.mesh`).

In-process tests see the one CPU device. Multi-device checks run
tests/mesh_subprocess_checks.py in a subprocess with fake CPU devices
(`--xla_force_host_platform_device_count` must be set before jax is imported).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
from support import BACKEND_COMPILE_EVENT, fake_cpu_devices_env, recorded_durations

from configs.arithmetic import get_config
from tba_jax import mesh as mesh_lib
from tba_jax import runtime
from tba_jax.errors import ConfigError
from tba_jax.models import compute_dtype_cast, init_model, kernel_mesh, preset
from tba_jax.placement import over_all_devices

EVALUATE_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "evaluate.py"
)
CHECKS_SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "mesh_subprocess_checks.py"
)
RESULT_PREFIX = "MESH_CHECK_RESULT "
RULES = [("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor")]


def _abstract(params):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


# --- split_devices / make_role_meshes --------------------------------------------------------


def test_one_device_is_shared_by_both_roles():
    devices = jax.devices()[:1]
    # Even a sampler count that would leave the learner nothing colocates on one device.
    for sampler_devices in (0.5, 1):
        sampler, learner = mesh_lib.split_devices(devices, sampler_devices, colocate=False)
        assert sampler == devices and learner == devices
    meshes = mesh_lib.make_role_meshes(0.5, False, {"data": -1}, {"fsdp": -1}, devices=devices)
    assert meshes.colocated
    assert list(meshes.sampler.devices.flat) == list(meshes.learner.devices.flat) == devices


def test_evaluation_puts_role_models_on_this_one_device_or_whole_when_the_run_split_them():
    config = get_config()
    placement = over_all_devices(config)  # the default axes: data takes the one device
    assert dict(placement.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert placement.rules == config.mesh.sampler_rules
    config.mesh.sampler_axes = {"data": 1, "fsdp": 1, "tensor": 2}  # a run's, on 2+ devices
    assert over_all_devices(config) is None  # whole on the default device (a warning)


@pytest.mark.parametrize(
    "sampler_devices, colocate, expected",
    [
        (1, False, ([0], [1, 2, 3])),
        (2, False, ([0, 1], [2, 3])),
        (0.5, False, ([0, 1], [2, 3])),
        (0.25, False, ([0], [1, 2, 3])),
        (0.01, False, ([0], [1, 2, 3])),  # a fraction gives at least one device
        (2, True, ([0, 1, 2, 3], [0, 1, 2, 3])),
    ],
)
def test_split_devices_counts_and_fractions(sampler_devices, colocate, expected):
    # split_devices only slices the list, so stand-in "devices" suffice.
    assert mesh_lib.split_devices([0, 1, 2, 3], sampler_devices, colocate) == expected


@pytest.mark.parametrize(
    "sampler_devices, match",
    [
        (4, "leaves no device for the learner"),
        (0.999, "leaves no device for the learner"),
        (1.5, "must be a count >= 1 or a fraction"),
        (0, "must be a count >= 1 or a fraction"),
        (-1, "must be a count >= 1 or a fraction"),
    ],
)
def test_split_devices_rejects_bad_counts(sampler_devices, match):
    with pytest.raises(ConfigError, match=match):
        mesh_lib.split_devices([0, 1, 2, 3], sampler_devices, colocate=False)


# --- make_mesh -------------------------------------------------------------------------------


@pytest.mark.parametrize("axes", [{}, {"fsdp": -1}, {"data": -1, "tensor": 1}, {"data": 1}])
def test_make_mesh_fills_the_minus_one_axis(axes):
    mesh = mesh_lib.make_mesh(jax.devices()[:1], axes)
    assert mesh.axis_names == mesh_lib.MESH_AXES
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize(
    "axes, match",
    [
        ({"data": 2}, r"need 2 devices and there are 1"),
        ({"data": 0}, r"must be >= 1 or -1"),
        ({"fsdp": -1, "tensor": 2}, r": 1 devices do not divide over these axes"),
        ({"data": -1, "fsdp": -1}, r"at most one mesh axis may be -1"),
        ({"model": 1}, r"unknown mesh axes \['model'\]"),
        ({"fsdp": -1, "expert": 1}, r"unknown mesh axes \['expert'\]"),
    ],
)
def test_make_mesh_rejects_bad_axes(axes, match):
    # A ConfigError: launchers print it as one line, not a traceback.
    with pytest.raises(ConfigError, match=match):
        mesh_lib.make_mesh(jax.devices()[:1], axes)


@pytest.mark.parametrize(
    "axes, match",
    [
        ({"data": 2}, r"mesh.learner_axes=\{'data': 2\}: these axes need 2 devices and the "
         r"learner has 1; .*mesh.sampler_devices and mesh.colocate"),
        ({"fsdp": -1, "tensor": 2}, r"mesh.learner_axes=.*: the learner's 1 devices do not "
         r"divide"),
    ],
)  # fmt: skip
def test_a_role_mesh_error_names_the_roles_key_and_the_split(axes, match):
    with pytest.raises(ConfigError, match=match):
        mesh_lib.role_mesh("learner", jax.devices()[:1], axes)


def test_a_role_mesh_error_by_process_says_where_its_devices_came_from():
    """roles_by_process gives a role whole processes, less each one's exchange device: the
    sampler/learner split keys would be the wrong advice there."""
    with pytest.raises(
        ConfigError, match=r"need 2 devices and the sampler has 1; .*\(roles_by_process: "
    ):
        mesh_lib.role_mesh("sampler", jax.devices()[:1], {"tensor": 2}, mesh_lib.DEVICES_BY_PROCESS)


def test_make_mesh_rejects_a_zero_axis_beside_minus_one():
    with pytest.raises(ValueError, match="fsdp"):
        mesh_lib.make_mesh(jax.devices()[:1], {"data": -1, "fsdp": 0})


# --- logical_to_spec / param_shardings ---------------------------------------------------


@pytest.mark.parametrize(
    "logical, expected",
    [
        (("embed", "mlp"), PartitionSpec("fsdp", "tensor")),
        (("vocab", "embed"), PartitionSpec(None, "fsdp")),  # no rule for vocab: replicated
        (("norm",), PartitionSpec(None)),
        (("heads", "head_dim", "embed"), PartitionSpec("tensor", None, "fsdp")),
        ((), PartitionSpec()),
    ],
)
def test_logical_to_spec_maps_names_by_rules(logical, expected):
    assert mesh_lib.logical_to_spec(logical, RULES) == expected


def test_logical_to_spec_rule_to_none_replicates():
    assert mesh_lib.logical_to_spec(("embed", "mlp"), [("embed", None)]) == PartitionSpec(
        None, None
    )


def test_logical_to_spec_rejects_two_logical_axes_on_one_mesh_axis():
    rules = [("embed", "fsdp"), ("mlp", "fsdp")]
    with pytest.raises(ValueError, match=r"map two axes of \('embed', 'mlp'\) onto one"):
        mesh_lib.logical_to_spec(("embed", "mlp"), rules)
    # Either name alone is fine.
    assert mesh_lib.logical_to_spec(("embed", "vocab"), rules) == PartitionSpec("fsdp", None)


def test_param_shardings_follow_the_model_logical_axes():
    model, params = init_model(preset("micro", vocab_size=16), 0)
    mesh = mesh_lib.make_mesh(jax.devices()[:1], {"fsdp": -1})
    rules = get_config().mesh.learner_rules
    shardings = mesh_lib.param_shardings(model.logical_axes, _abstract(params), mesh, rules)
    assert jax.tree.structure(shardings) == jax.tree.structure(params)
    for axes, sharding in zip(
        jax.tree.leaves(model.logical_axes, is_leaf=lambda x: isinstance(x, tuple)),
        jax.tree.leaves(shardings),
        strict=True,
    ):
        assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh
        assert sharding.spec == mesh_lib.logical_to_spec(axes, rules)
    assert shardings["embedding"].spec == PartitionSpec(None, "fsdp")
    assert shardings["blocks"][0]["mlp"]["w_up"].spec == PartitionSpec("fsdp", "tensor")


def test_param_shardings_reject_a_dim_that_does_not_divide():
    # An abstract mesh gives an fsdp axis of size 2 without needing two devices.
    mesh = AbstractMesh((1, 2, 1), mesh_lib.MESH_AXES)
    abstract = {"w": jax.ShapeDtypeStruct((3, 8), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"shape \(3, 8\) cannot be split over mesh axis 'fsdp' of size 2.*'embed'",
    ):
        mesh_lib.param_shardings({"w": ("embed", "mlp")}, abstract, mesh, RULES)
    # A replicated dim need not divide; a split one that divides is fine.
    ok = mesh_lib.param_shardings(
        {"w": ("vocab", "embed")}, {"w": jax.ShapeDtypeStruct((3, 8), np.float32)}, mesh, RULES
    )
    assert ok["w"].spec == PartitionSpec(None, "fsdp")


# --- publish, colocated (one device) ----------------------------------------------------------


def _micro_params_and_colocated_shardings():
    """A micro model's params and their (learner, sampler) shardings on one device's two
    role meshes (colocated)."""
    model, params = init_model(preset("micro", vocab_size=16), 0)
    meshes = mesh_lib.make_role_meshes(0.5, False, {"data": -1}, {"fsdp": -1})
    assert meshes.colocated
    rules = get_config().mesh.learner_rules
    learner_shardings, sampler_shardings = (
        mesh_lib.param_shardings(model.logical_axes, _abstract(params), mesh, rules)
        for mesh in (meshes.learner, meshes.sampler)
    )
    return params, learner_shardings, sampler_shardings


# bfloat16 compute: a publish through this cast holds the weights as the searchers use them
TO_BFLOAT16 = compute_dtype_cast(preset("micro", vocab_size=16, dtype="bfloat16"))


@pytest.mark.parametrize("cast", [None, TO_BFLOAT16], ids=["as_stored", "compute_dtype"])
def test_colocated_publish_copies_so_the_learner_may_donate(cast):
    """Same device, same shardings: publish must still copy, or donation would free it;
    through a cast too, whose float32 leaves (the norms) it leaves as they are."""
    params, learner_shardings, sampler_shardings = _micro_params_and_colocated_shardings()
    host = jax.device_get(params if cast is None else cast(params))
    learner_params = jax.device_put(params, learner_shardings, may_alias=False)
    published = mesh_lib.publish(learner_params, sampler_shardings, cast)
    copy_fn = functools.partial(mesh_lib.publish, cast=cast)
    store = runtime.PolicyStore(sampler_shardings, learner_params, version=0, copy_fn=copy_fn)
    store.publish(learner_params, version=2)
    for a, b in zip(jax.tree.leaves(learner_params), jax.tree.leaves(published), strict=True):
        assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    assert jax.tree.map(lambda x: x.sharding, published) == sampler_shardings
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(published)}
    expected = {np.dtype(np.float32)} | ({jnp.dtype(jnp.bfloat16)} if cast else set())
    assert dtypes == expected

    update = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)
    update(learner_params)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(learner_params))

    store_params, version = store.get()
    assert version == 2
    for tree in (published, store_params):
        for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(host), strict=True):
            assert not got.is_deleted()
            np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("cast", [None, TO_BFLOAT16], ids=["as_stored", "compute_dtype"])
def test_a_publish_after_the_first_compiles_nothing(cast):
    """The colocated copy is compiled once per sampler sharding tree (and cast), then
    reused."""
    params, learner_shardings, sampler_shardings = _micro_params_and_colocated_shardings()
    learner_params = jax.device_put(params, learner_shardings, may_alias=False)
    jax.block_until_ready(mesh_lib.publish(learner_params, sampler_shardings, cast))
    newer = jax.block_until_ready(jax.tree.map(lambda x: x + 1.0, learner_params))
    with recorded_durations(BACKEND_COMPILE_EVENT) as compiles:
        published = mesh_lib.publish(newer, sampler_shardings, cast)
    assert compiles == []
    assert jax.tree.map(lambda x: x.sharding, published) == sampler_shardings
    expected = newer if cast is None else cast(newer)
    for got, want in zip(jax.tree.leaves(published), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "sizes, rows, split, row_axes, split_axes",
    [
        ((2, 2, 2), 8, 4, ("data", "fsdp"), ("tensor",)),
        ((2, 2, 2), 6, 3, ("data",), ()),  # 6 rows over data only; 3 heads not over tensor 2
        ((3, 2, 1), 4, 1, ("fsdp",), ()),  # data 3 does not divide 4 rows, fsdp 2 does
        ((1, 4, 1), 6, 2, (), ()),
    ],
)
def test_kernels_split_over_the_mesh_axes_that_divide_their_rows_and_heads(
    sizes, rows, split, row_axes, split_axes
):
    mesh = AbstractMesh(sizes, mesh_lib.MESH_AXES)
    axes = kernel_mesh.shard_axes(mesh, rows, split)
    assert axes == {kernel_mesh.ROWS: row_axes, kernel_mesh.SPLIT: split_axes}
    dims = (kernel_mesh.ROWS, None, kernel_mesh.SPLIT)
    assert kernel_mesh.spec(dims, axes) == PartitionSpec(row_axes or None, None, split_axes or None)


def test_a_kernel_outside_any_mesh_is_called_as_it_is():
    calls = []
    out = kernel_mesh.per_shard(
        lambda x: calls.append(x) or x + 1, (np.zeros(3),), ((kernel_mesh.ROWS,),), (None,),
        rows=3, split=1,
    )  # fmt: skip
    assert len(calls) == 1 and np.array_equal(out, np.ones(3))


# --- several fake devices, in subprocesses ---------------------------------------------------


def _run_check(name: str, num_devices: int, *args: str, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, CHECKS_SCRIPT, name, *args],
        env=fake_cpu_devices_env(num_devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"check {name!r} on {num_devices} fake devices exited with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


@pytest.fixture(scope="module")
def publish_result():
    return _run_check("publish", 2, timeout=180)


@pytest.fixture(scope="module")
def fsdp_result():
    return _run_check("fsdp", 4, timeout=240)


@pytest.fixture(scope="module")
def train_result(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mesh_train")
    summary = _run_check("train", 2, str(workdir), timeout=400)
    restored = summary.pop("restored_on_mesh")
    with open(workdir / "summary.json") as f:
        assert json.load(f) == summary
    return {**summary, "workdir": str(workdir), "restored_on_mesh": restored}


def test_two_devices_split_into_disjoint_roles(publish_result):
    r = publish_result
    assert r["sampler_mesh_devices"] == [0]
    assert r["learner_mesh_devices"] == [1]
    assert r["colocated"] is False


def test_publish_lands_on_the_sampler_device_only(publish_result):
    r = publish_result
    assert r["num_leaves"] > 0
    assert r["learner_param_devices"] == [1]
    assert r["new_learner_param_devices"] == [1]
    assert r["published_devices"] == [0]
    assert r["store_devices"] == [0]
    assert r["store_version"] == 3
    assert r["published_equal"] and r["store_equal"]


def test_published_params_survive_the_learner_donating_its_buffers(publish_result):
    r = publish_result
    assert r["all_donated"], "the jitted update should have consumed the learner's buffers"
    # Read after the donation (see check_publish): still the pre-update values.
    assert r["published_equal"] and r["store_equal"]
    assert r["update_equal"]


def test_rules_that_split_a_parameter_unevenly_are_refused_before_the_task_is_built(
    fsdp_result,
):
    r = fsdp_result["refused"]
    assert r["error"] is not None, r
    assert r["error"].startswith("The policy on the learner mesh: A parameter with axes")
    assert "(mesh.learner_rules, mesh.learner_axes)" in r["error"]
    assert r["workdir_entries"] == []  # no data prepared, nothing written


def test_fsdp_learner_mesh_splits_embed_over_its_two_devices(fsdp_result):
    r = fsdp_result
    assert r["learner_mesh_devices"] == [2, 3]
    assert r["learner_mesh_shape"] == {"data": 1, "fsdp": 2, "tensor": 1}
    # embedding: (vocab, embed) = (16, 32) → one (16, 16) half per learner device.
    assert r["embedding_shape"] == [16, 32]
    assert r["embedding_spec"] == [None, "fsdp"]
    assert r["embedding_shards"] == [[2, [16, 16]], [3, [16, 16]]]
    # w_up: (embed, mlp) = (32, 64); tensor has size 1, so only embed is split.
    assert r["w_up_spec"] == ["fsdp", "tensor"]
    assert r["w_up_shards"] == [[2, [16, 64]], [3, [16, 64]]]
    # norm scales have no rule: a full copy on each learner device.
    assert r["norm_shards"] == [[2, [32]], [3, [32]]]


def test_fsdp_train_step_runs_sharded_and_matches_one_device(fsdp_result):
    r = fsdp_result
    # 8 rows (B=2 × K=4) split over the 2 batch shards.
    assert r["batch_shards"] == [[2, [4, 6]], [3, [4, 6]]]
    assert r["step"] == 1
    assert r["state_donated"]
    assert r["new_embedding_spec"] == [None, "fsdp"]
    assert r["new_embedding_shards"] == [[2, [16, 16]], [3, [16, 16]]]
    metrics, reference = r["metrics"], r["ref_metrics"]
    assert {"loss", "grad_norm", "beta"} <= set(metrics)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert metrics["grad_norm"] > 0
    assert set(metrics) == set(reference)
    for name, value in metrics.items():
        assert value == pytest.approx(reference[name], rel=1e-4, abs=1e-5), name
    assert r["max_param_diff_vs_single_device"] < 1e-5


def test_frozen_role_models_split_over_the_sampler_mesh_score_as_on_one_device(fsdp_result):
    r = fsdp_result["roles"]
    # the reward model's w_up (embed, mlp) = (128, 384): mlp split over tensor (2)
    assert r["rm_w_up_shape"] == [128, 384]
    assert r["rm_w_up_spec"] == [None, "tensor"]
    assert r["rm_w_up_shard_shape"] == [128, 192]
    # rows split over data, batches of 4 rows or of 3 (padded to 4): one device's scores
    assert r["rm_max_diff_batch_4"] < 1e-5 and r["rm_max_diff_batch_3"] < 1e-5
    assert r["rows_4_shard_rows"] == [2]  # 4 rows over data (2): 2 a device
    assert r["rows_3_shard_rows"] == [2]  # 3 rows, padded to 4: 2 a device
    assert r["judge_max_diff"] < 1e-4
    assert r["victim_params_devices"] == 4
    assert r["victim_answers"] == [2, 2, 2]
    # sampled on split params and padded rows: the one-device answers (the same keys)
    assert r["victim_same_answers"]
    assert r["victim_engine_answers"] == [2, 2, 2]
    assert r["victim_engine_same_answers"]  # the slot engine's, slots split over data
    assert r["evaluation_mesh"] == {"data": 2, "fsdp": 1, "tensor": 2}
    # a BERT judge (MiniLM's first two layers): its MLP split over tensor, the query's
    # [layers, embed, heads] = [2, 384, 384] to 192 heads' columns a device; the logits as
    # on one device, in batches of 4 and of 3 (padded to 4)
    assert r["bert_mlp_in_spec"] == [None, None, "tensor"]
    assert r["bert_query_shard_shape"] == [2, 384, 192]
    assert r["bert_whole_devices"] == 1
    assert r["bert_judge_max_diff_batch_4"] < 1e-4 and r["bert_judge_max_diff_batch_3"] < 1e-4
    assert r["embedder_devices"] == 4 and r["embedder_max_diff"] < 1e-5
    # a rule that splits a parameter unevenly: one line naming the model and what to change
    for key, who in (("role_split_error", "task.reward_model"), ("policy_split_error", "policy")):
        assert who in r[key] and "cannot be split over mesh axis 'tensor'" in r[key]
        assert "mesh.sampler_rules, mesh.sampler_axes" in r[key]


def test_pallas_kernels_run_per_shard_on_a_mesh_and_match_one_device(fsdp_result):
    """On a (data 2, tensor 2) sampler mesh the attention-input (norm, Q/K/V, rotary and
    cache write), decode attention, gated MLP and projection kernels (the down
    projection's contraction split over tensor, its sums added across devices), and on a
    (fsdp 2, tensor 2) learner mesh splash attention, run inside a shard_map (each
    device on its rows and heads; XLA refuses to split a TPU kernel and gathers a GPU
    kernel's inputs), and decode and train as the plain model does on one device; on one
    device the kernels are called as they are."""
    sampler, learner = fsdp_result["kernels"]["sampler"], fsdp_result["kernels"]["learner"]
    assert sampler["calls"]["pallas"] > 0
    assert sampler["calls"]["in_shard_map"] == sampler["calls"]["pallas"]
    one_device = {**sampler["calls"], "in_shard_map": 0}
    assert sampler["one_device_calls"] == one_device
    kernels = {"decode_qkv", "decode_attention", "gated_mlp", "decode_projection"}
    assert set(sampler["calls"]["names"]) == kernels
    assert all(name.startswith("splash_") for name in learner["calls"]["names"])
    assert sampler["same_tokens"] and sampler["max_logp_diff"] < 1e-4
    # the projections in one part add the residual in the kernel, per shard of 4 row blocks
    assert sampler["one_part_same_tokens"] and sampler["one_part_max_logp_diff"] < 1e-4
    one_part = sampler["one_part_calls"]
    assert one_part["in_shard_map"] == one_part["pallas"] == sampler["calls"]["pallas"]
    assert learner["calls"]["pallas"] > 0
    assert learner["calls"]["in_shard_map"] == learner["calls"]["pallas"]
    assert abs(learner["loss_ratio"] - 1) < 1e-6 and abs(learner["grad_norm_ratio"] - 1) < 1e-5
    # Adam's first step is about ±lr (1e-2) per weight: float rounding moves it a little
    assert learner["max_param_diff"] < 1e-4


def test_async_run_on_two_devices_end_to_end(train_result):
    s = train_result
    assert s["num_devices"] == 2
    assert s["colocated"] is False
    assert s["mode"] == "async" and s["variant"] == "smoke"
    assert s["learner_steps"] == 4
    assert s["samples_generated"] > 0
    for key in ("eval_accuracy_start", "eval_accuracy_end"):
        assert isinstance(s[key], float) and 0.0 <= s[key] <= 1.0, (key, s[key])


def test_a_checkpoint_restores_straight_onto_the_evaluation_mesh(train_result):
    r = train_result["restored_on_mesh"]
    assert r["whole_devices"] == [0]
    assert r["params_devices"] == [0, 1] and r["reference_devices"] == [0, 1]
    assert r["same_params"]


def test_evaluate_splits_the_policy_batches_over_the_devices_and_agrees_with_one(
    train_result, tmp_path
):
    """experiments/evaluate.py on 2 devices: the policy on both, each batch's rows split
    over data; the same metrics as on one device."""
    workdir = train_result["workdir"]
    metrics = {}
    for devices in (2, 1):
        out = tmp_path / f"eval_{devices}.json"
        done = subprocess.run(
            [
                sys.executable,
                EVALUATE_SCRIPT,
                f"--workdir={workdir}",
                "--num_samples=2",
                "--ks=1,2",
                f"--out={out}",
            ],
            env=fake_cpu_devices_env(devices),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("Evaluating on 2 devices: {'data': 2" in done.stderr) == (devices == 2)
        metrics[devices] = {
            key: value
            for key, value in json.loads(out.read_text()).items()
            if "pass@" in key or key.endswith(("reward", "length"))
        }
    assert metrics[2] == metrics[1] and "greedy_pass@1" in metrics[1]


def test_slot_engine_on_a_sampler_mesh_equals_one_device_greedy(publish_result):
    r = publish_result["engine"]
    assert len(set(r["lengths"])) >= 3, r["lengths"]  # refills happen at many lengths
    # tensor (2): the params split, every slot on both devices
    assert r["tensor"]["params_split"] == 2 and r["tensor"]["slot_shards"] == [4, 4]
    # data (2): the params on both, the 4 slots split 2 + 2
    assert r["data"]["params_split"] == 2 and r["data"]["slot_shards"] == [2, 2]
    for mesh in ("tensor", "data"):
        assert r[mesh]["same_tokens"] and r[mesh]["max_logp_diff"] < 1e-4, mesh


def test_a_search_call_splits_its_rows_over_the_sampler_data_axis(publish_result):
    """Each sampler device generates and scores its share of a call's rows (before, each
    computed every row), and the samples are the one-device call's; so do evaluation
    batches and VinePPO's rollouts."""
    r = publish_result["search"]
    assert r["rows"] == 9  # 3 prompts × 3 samples; padded to 10 on the mesh, then dropped
    assert r["row_shards"] == [[9], [5, 5]]  # one device: all 9 rows; the mesh: 5 each
    assert r["same_responses"] and r["max_logp_diff"] < 1e-4
    assert r["same_greedy_batches"]
    # VinePPO's rollouts: 3 starts × 3 in calls of the batch's 2 rows × 3 (the last
    # padded), split 3 + 3; the same advantages as on one device
    assert r["vine_row_shards"] == [[6], [6], [3, 3], [3, 3]]
    assert r["vine_moved"] > 0 and r["vine_max_diff"] < 1e-5


def test_every_mesh_axis_of_both_roles_can_be_set_from_a_variant():
    from configs.arithmetic import get_config

    config = get_config(
        "mesh.learner_axes.data=-1,mesh.learner_axes.fsdp=1,mesh.sampler_axes.tensor=1"
    )
    assert dict(config.mesh.learner_axes) == {"data": -1, "fsdp": 1, "tensor": 1}
    assert dict(config.mesh.sampler_axes) == {"data": -1, "fsdp": 1, "tensor": 1}
    for axes in (config.mesh.learner_axes, config.mesh.sampler_axes):
        assert mesh_lib.make_mesh(jax.devices()[:1], axes).axis_names == mesh_lib.MESH_AXES
    # setting one axis to -1 without giving the default -1 axis a size says what to do
    config = get_config("mesh.learner_axes.data=-1")
    with pytest.raises(ValueError, match=r"learner_axes\.fsdp=1"):
        mesh_lib.make_mesh(jax.devices()[:1], config.mesh.learner_axes)


def test_slots_that_do_not_divide_over_the_data_shards_are_warned_of(caplog):
    from tba_jax.train import warn_if_slots_repeat_rows

    data_split = AbstractMesh((2, 1, 1), mesh_lib.MESH_AXES)
    tensor_split = AbstractMesh((1, 1, 2), mesh_lib.MESH_AXES)
    for variant, mesh, warns in (
        ("search.engine=slots,search.slots=7", data_split, True),
        ("search.engine=slots,search.slots=8", data_split, False),
        ("search.engine=slots,search.slots=7", tensor_split, False),
        ("search.engine=batch,search.slots=7", data_split, False),
    ):
        caplog.clear()
        warn_if_slots_repeat_rows(get_config(variant), mesh)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(warned) == warns, (variant, dict(mesh.shape), warned)
        if warns:
            assert "search.slots=7 does not divide over the sampler mesh's 2 data" in warned[0]
