"""Multi-device checks for tests/test_mesh.py, run in a subprocess with fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=N python mesh_subprocess_checks.py CHECK [ARG]

The device count must be fixed before jax is imported, hence the subprocess. Each
check asserts what it can locally and prints one JSON line, prefixed with
RESULT_PREFIX, of observations for the test to assert on.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

# The repo root (for `configs`), when run as a script from tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from configs.arithmetic import get_config
from tba_jax import learner, losses, runtime
from tba_jax import mesh as mesh_lib
from tba_jax.models import init_model, preset

RESULT_PREFIX = "MESH_CHECK_RESULT "


def _abstract(params):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def _max_diff(tree, reference) -> float:
    """The largest absolute difference between two trees' matching leaves."""
    leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True)
    return max(float(np.max(np.abs(jax.device_get(a) - jax.device_get(r)))) for a, r in leaves)


def _device_ids(array) -> list[int]:
    return sorted(d.id for d in array.sharding.device_set)


def _all_device_ids(tree) -> list[int]:
    return sorted({i for leaf in jax.tree.leaves(tree) for i in _device_ids(leaf)})


def check_publish() -> dict:
    """2 devices: disjoint roles; published params live on the sampler only and survive
    the learner donating its buffers."""
    assert jax.device_count() == 2, jax.devices()
    config = get_config()
    meshes = mesh_lib.make_role_meshes(
        sampler_devices=1,
        colocate=False,
        sampler_axes={"data": -1},
        learner_axes={"fsdp": -1},
    )
    model, params = init_model(preset("micro", vocab_size=16), 0)
    abstract = _abstract(params)
    learner_shardings = mesh_lib.param_shardings(
        model.logical_axes, abstract, meshes.learner, config.mesh.learner_rules
    )
    sampler_shardings = mesh_lib.param_shardings(
        model.logical_axes, abstract, meshes.sampler, config.mesh.sampler_rules
    )
    host_before = jax.device_get(params)
    learner_params = jax.device_put(params, learner_shardings)
    learner_param_devices = _all_device_ids(learner_params)

    # Plain publish, then the PolicyStore's; no blocking in between, so the
    # (asynchronous) copies may still be in flight when the learner donates.
    published = mesh_lib.publish(learner_params, sampler_shardings)
    store = runtime.PolicyStore(sampler_shardings, learner_params, version=0)
    store.publish(learner_params, version=3)
    update = jax.jit(
        lambda p: jax.tree.map(lambda x: x * 2.0 + 1.0, p),
        donate_argnums=0,
        out_shardings=learner_shardings,
    )
    new_learner_params = update(learner_params)
    donated = [leaf.is_deleted() for leaf in jax.tree.leaves(learner_params)]

    store_params, store_version = store.get()
    # Reading the published arrays must work after the donation.
    published_host = jax.device_get(published)
    store_host = jax.device_get(store_params)
    new_host = jax.device_get(new_learner_params)

    def equal(a, b):
        return all(
            np.array_equal(x, y)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )

    expected_new = jax.tree.map(lambda x: x * 2.0 + 1.0, host_before)
    return {
        "sampler_mesh_devices": sorted(d.id for d in meshes.sampler.devices.flat),
        "learner_mesh_devices": sorted(d.id for d in meshes.learner.devices.flat),
        "colocated": meshes.colocated,
        "learner_param_devices": learner_param_devices,
        "new_learner_param_devices": _all_device_ids(new_learner_params),
        "published_devices": _all_device_ids(published),
        "store_devices": _all_device_ids(store_params),
        "store_version": store_version,
        "all_donated": all(donated),
        "published_equal": equal(published_host, host_before),
        "store_equal": equal(store_host, host_before),
        "update_equal": all(
            np.allclose(x, y)
            for x, y in zip(jax.tree.leaves(new_host), jax.tree.leaves(expected_new), strict=True)
        ),
        "num_leaves": len(jax.tree.leaves(published)),
    }


def _random_batch(rng: np.random.Generator, b: int, k: int, p: int, t: int, vocab: int) -> dict:
    n = b * k
    prompt_tokens = np.repeat(rng.integers(3, vocab, size=(b, p)).astype(np.int32), k, axis=0)
    prompt_tokens[::2, :2] = 0  # some left padding
    lengths = rng.integers(1, t + 1, size=n)
    response_mask = np.arange(t)[None, :] < lengths[:, None]
    response_tokens = np.where(response_mask, rng.integers(3, vocab, size=(n, t)), 0)
    return {
        "prompt_tokens": prompt_tokens,
        "prompt_mask": prompt_tokens != 0,
        "response_tokens": response_tokens.astype(np.int32),
        "response_mask": response_mask,
        "reward": rng.integers(0, 2, size=n).astype(np.float32),
        "logp_ref": rng.normal(-8.0, 1.0, size=n).astype(np.float32),
        "logp_behaviour": rng.normal(-8.0, 1.0, size=n).astype(np.float32),
    }


def _run_train_step(model, params, batch, mesh, rules, k):
    """One train step of the real learner on `mesh`; returns the new state, its metrics, the
    placed batch, the state before and the jitted step."""
    optimizer = learner.make_optimizer(
        learner.OptimConfig(learning_rate=1e-2, total_steps=10, grad_clip_norm=1.0)
    )
    abstract = _abstract(params)
    shardings = mesh_lib.param_shardings(model.logical_axes, abstract, mesh, rules)
    state_sharding = learner.train_state_shardings(optimizer, abstract, shardings, mesh)
    state = learner.init_train_state(params, optimizer, state_sharding)
    step = learner.make_train_step(
        model,
        losses.get_loss("tb"),
        optimizer,
        losses.make_beta_schedule("constant", 0.1, 0.1, 1),
        samples_per_prompt=k,
        num_microbatches=1,
        temperature=1.0,
        state_sharding=state_sharding,
        mesh=mesh,
    )
    device_batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    new_state, metrics = step(state, device_batch)
    return new_state, jax.device_get(metrics), device_batch, state, step


def check_fsdp() -> dict:
    """4 devices: a 2-device fsdp learner mesh really splits `embed`, and trains."""
    assert jax.device_count() == 4, jax.devices()
    rules = get_config().mesh.learner_rules
    meshes = mesh_lib.make_role_meshes(
        sampler_devices=2,
        colocate=False,
        sampler_axes={"data": -1},
        learner_axes={"fsdp": -1},
    )
    lmesh = meshes.learner
    model, params = init_model(preset("micro", vocab_size=16), 0)
    shardings = mesh_lib.param_shardings(model.logical_axes, _abstract(params), lmesh, rules)
    placed = jax.device_put(params, shardings)
    embedding = placed["embedding"]  # logical axes (vocab, embed)
    w_up = placed["blocks"][0]["mlp"]["w_up"]  # (embed, mlp)
    norm = placed["final_norm"]["scale"]  # (norm,): no rule, replicated

    def shards(array):
        return sorted((s.device.id, list(s.data.shape)) for s in array.addressable_shards)

    b, k, p, t = 2, 4, 5, 6
    batch = _random_batch(np.random.default_rng(0), b, k, p, t, vocab=16)
    new_state, metrics, device_batch, old_state, _ = _run_train_step(
        model, params, batch, lmesh, rules, k
    )
    # The same step on a single device is the reference.
    single = mesh_lib.make_mesh(jax.devices()[:1], {})
    ref_state, ref_metrics, *_ = _run_train_step(model, params, batch, single, rules, k)
    max_param_diff = _max_diff(new_state.params, ref_state.params)
    return {
        "learner_mesh_shape": dict(lmesh.shape),
        "learner_mesh_devices": sorted(d.id for d in lmesh.devices.flat),
        "embedding_spec": [a for a in embedding.sharding.spec],
        "embedding_shards": shards(embedding),
        "w_up_spec": [a for a in w_up.sharding.spec],
        "w_up_shards": shards(w_up),
        "norm_shards": shards(norm),
        "embedding_shape": list(embedding.shape),
        "batch_shards": shards(device_batch["response_tokens"]),
        "state_donated": old_state.params["embedding"].is_deleted(),
        "new_embedding_spec": [a for a in new_state.params["embedding"].sharding.spec],
        "new_embedding_shards": shards(new_state.params["embedding"]),
        "step": int(jax.device_get(new_state.step)),
        "metrics": {name: float(np.asarray(v)) for name, v in metrics.items()},
        "ref_metrics": {name: float(np.asarray(v)) for name, v in ref_metrics.items()},
        "max_param_diff_vs_single_device": max_param_diff,
    }


def check_train(workdir: str) -> dict:
    """2 devices: the async smoke run end to end (its summary), and its checkpoint restored
    straight onto a 2-device mesh as `evaluate.py` restores it (under "restored_on_mesh")."""
    from tba_jax import runs
    from tba_jax.train import train_and_evaluate

    assert jax.device_count() == 2, jax.devices()
    config = get_config("smoke")
    summary = train_and_evaluate(config, workdir)
    mesh = mesh_lib.make_mesh(jax.devices(), {"data": -1})
    whole = runs.restore_run(config, workdir)
    placed = runs.restore_run(config, workdir, mesh=mesh, rules=config.mesh.sampler_rules)
    leaves = zip(jax.tree.leaves(whole.params), jax.tree.leaves(placed.params), strict=True)
    restored = {
        "whole_devices": _all_device_ids(whole.params),
        "params_devices": _all_device_ids(placed.params),
        "reference_devices": _all_device_ids(placed.reference_params),
        "same_params": all(np.array_equal(a, b) for a, b in leaves),
    }
    return {**summary, "restored_on_mesh": restored}


def check_engine() -> dict:
    """2 devices: the slot engine on params split over a 2-device tensor-parallel sampler
    mesh, and on a (data 2) one with its slots split over the two devices, gives the
    one-device batch generator's greedy responses."""
    from tba_jax.sampling.engine import EngineConfig, Request, SlotEngine
    from tba_jax.sampling.generate import SamplingConfig, make_generate_fn

    assert jax.device_count() == 2, jax.devices()
    eos, pad, prompt_len, prompts = 2, 0, 5, 8
    model, params = init_model(preset("micro", vocab_size=16, init_std=0.5, num_kv_heads=2), 0)
    rules = get_config().mesh.sampler_rules
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 16, size=(prompts, prompt_len)).astype(np.int32)
    mask = np.arange(prompt_len)[None] >= rng.integers(0, prompt_len, size=(prompts, 1))
    tokens = np.where(mask, tokens, pad).astype(np.int32)
    greedy = SamplingConfig(max_new_tokens=10, greedy=True)
    reference = jax.device_get(
        make_generate_fn(model, greedy, eos_id=eos, pad_id=pad)(
            params, tokens, mask, jax.random.key(0)
        )
    )
    lengths = [int(n) for n in reference.lengths]
    out: dict = {"lengths": lengths}
    for name, axes in (("tensor", {"tensor": 2}), ("data", {"data": 2})):
        mesh = mesh_lib.make_mesh(jax.devices(), axes)
        sharded = jax.device_put(
            params, mesh_lib.param_shardings(model.logical_axes, _abstract(params), mesh, rules)
        )
        engine = SlotEngine(
            model,
            greedy,
            EngineConfig(slots=4, chunk_steps=3, min_width=2, compact_min_steps=0),
            max_prompt_len=prompt_len,
            eos_id=eos,
            pad_id=pad,
        )
        requests = [Request(row, tokens[row], mask[row], 1) for row in range(prompts)]
        finished = {
            item.key: item
            for chunk in engine.run(lambda p=sharded: (p, 0), requests, jax.random.key(0))
            for item in chunk
        }
        empty = engine._empty_slots(4, sharded)
        out[name] = {
            "params_split": len(_all_device_ids(sharded)),
            "slot_shards": sorted(s.data.shape[0] for s in empty.live.addressable_shards),
            "same_tokens": all(
                finished[row].tokens.tolist() == reference.tokens[row, : lengths[row]].tolist()
                for row in range(prompts)
            ),
            "max_logp_diff": max(
                float(
                    np.max(
                        np.abs(finished[row].token_logp - reference.token_logp[row, : lengths[row]])
                    )
                )
                for row in range(prompts)
            ),
        }
    return out


def check_data_split_search() -> dict:
    """2 devices: on a (data 2) sampler mesh a search call's rows are split over the two
    devices (9 rows padded to 10) and its trajectories are the one-device call's; so are
    `generated_batches`' greedy batches (3 rows padded to 4) and VinePPO's rollouts (two
    calls of 6 rows)."""
    from support import hand_made_trajectory

    from tba_jax import vineppo
    from tba_jax.metrics import RateMeter, TimeSplit
    from tba_jax.models.tokenizers import CharTokenizer
    from tba_jax.runtime import SearchWorker
    from tba_jax.sampling.generate import SamplingConfig, generated_batches, make_generate_fn
    from tba_jax.sampling.scoring import make_score_fn
    from tba_jax.trajectories import collate

    assert jax.device_count() == 2, jax.devices()
    tokenizer = CharTokenizer.for_text()
    model, params = init_model(preset("micro", vocab_size=tokenizer.vocab_size, init_std=0.5), 0)
    mesh = mesh_lib.make_mesh(jax.devices(), {"data": -1})
    placed = jax.device_put(
        params,
        mesh_lib.param_shardings(
            model.logical_axes, _abstract(params), mesh, get_config().mesh.sampler_rules
        ),
    )
    sampled = make_generate_fn(
        model,
        SamplingConfig(max_new_tokens=8, temperature=1.0),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
    )
    row_shards = []

    def recorded(*args):
        out = sampled(*args)
        row_shards.append(sorted(shard.data.shape[0] for shard in out.tokens.addressable_shards))
        return out

    examples = [{"id": i, "prompt": text} for i, text in enumerate(["2+3=", "hello", "x y z"])]

    def search(search_params) -> list:
        worker = SearchWorker(
            generate_fn=recorded,
            score_fn=make_score_fn(model, temperature=1.0),
            reference_params=search_params,
            tokenizer=tokenizer,
            rewards_fn=lambda batch, texts: np.array([len(t) for t in texts], np.float32),
            max_prompt_len=8,
            samples_per_prompt=3,
            time_split=TimeSplit(),
            rates=RateMeter(),
        )
        return worker.search(search_params, 1, examples, jax.random.key(0))

    whole, split = search(params), search(placed)
    greedy = make_generate_fn(
        model,
        SamplingConfig(max_new_tokens=8, greedy=True),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
    )

    def greedy_tokens(greedy_params) -> list:
        batches = generated_batches(
            greedy,
            greedy_params,
            examples * 2,
            tokenizer,
            max_prompt_len=8,
            batch_size=3,
            rng=jax.random.key(1),
        )
        return [np.asarray(out.tokens).tolist() for *_, out in batches]

    search_shards = list(row_shards)

    def vine_advantages(vine_params) -> np.ndarray:
        """VinePPO's Monte Carlo advantages of two responses: 3 starts × 3 rollouts."""
        prompt = tokenizer.encode("2+3=")
        rows = [
            hand_made_trajectory(prompt, [*tokenizer.encode(text), tokenizer.eos_id], reward=1.0)
            for text in ("1,2", "345")
        ]
        batch = collate(
            rows,
            max_prompt_len=8,
            max_response_len=8,
            pad_id=tokenizer.pad_id,
            prompt_ids=np.array([0]),
            from_recency=np.array([True]),
        )
        stage = vineppo.MonteCarloValues(
            generate_fn=recorded,
            tokenizer=tokenizer,
            rewards_fn=lambda examples, texts: np.array([len(t) for t in texts], np.float32),
            examples_by_id={0: {"id": 0}},
            max_prompt_len=8,
            max_response_len=8,
            is_boundary=vineppo.boundary_tokens(tokenizer, ","),
            config=vineppo.VineConfig(rollouts=3, step_delimiters=","),
            time_split=TimeSplit(),
            rates=RateMeter(),
        )
        return stage.advantages(vine_params, batch, jax.random.key(2))

    del row_shards[:]
    vine_whole, vine_split = vine_advantages(params), vine_advantages(placed)
    return {
        "rows": len(split),
        "row_shards": search_shards,
        "vine_row_shards": list(row_shards),
        "vine_max_diff": float(np.max(np.abs(vine_whole - vine_split))),
        "vine_moved": float(np.max(np.abs(vine_whole))),
        "same_responses": all(
            a.response_tokens.tolist() == b.response_tokens.tolist() and a.reward == b.reward
            for a, b in zip(whole, split, strict=True)
        ),
        "max_logp_diff": max(
            float(np.max(np.abs(a.token_logp_behaviour - b.token_logp_behaviour), initial=0))
            + float(np.max(np.abs(a.token_logp_ref - b.token_logp_ref), initial=0))
            for a, b in zip(whole, split, strict=True)
        ),
        "same_greedy_batches": greedy_tokens(params) == greedy_tokens(placed),
    }


def _write_bert_judge(folder: str, layers: int = 2) -> None:
    """Writes into `folder` a BertForSequenceClassification made with NumPy from the
    packaged all-MiniLM-L6-v2 (its first `layers` layers, its tokenizer, a random 2-label
    head)."""
    import pathlib
    import shutil

    from safetensors.numpy import load_file, save_file

    from tba_jax.rewards.diversity import minilm_path

    source = pathlib.Path(minilm_path())
    folder = pathlib.Path(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    labels = {"0": "safe", "1": "toxic"}
    config.update(
        architectures=["BertForSequenceClassification"],
        num_hidden_layers=layers,
        id2label=labels,
        label2id={name: int(index) for index, name in labels.items()},
    )
    (folder / "config.json").write_text(json.dumps(config))
    kept = tuple(f"encoder.layer.{i}." for i in range(layers))
    tensors = {
        name: value
        for name, value in load_file(str(source / "model.safetensors")).items()
        if not name.startswith("encoder.layer.") or name.startswith(kept)
    }
    rng = np.random.default_rng(0)
    tensors["classifier.weight"] = rng.normal(0, 0.5, (2, config["hidden_size"])).astype(np.float32)
    tensors["classifier.bias"] = np.zeros(2, np.float32)
    save_file(tensors, str(folder / "model.safetensors"))


def check_roles() -> dict:
    """4 devices: frozen role models placed on a (data 2, tensor 2) sampler mesh by the
    sampler rules split their weights over the tensor axis and score as on one device
    (rows split over the data axis, padded to a multiple of its size); the victim
    generates on its split weights; a BERT judge is split the same way."""
    from tba_jax.config_lib import ConfigError
    from tba_jax.models.tokenizers import CharTokenizer
    from tba_jax.placement import RolePlacement, over_all_devices
    from tba_jax.rewards import judges, redteam
    from tba_jax.rewards.reward_model import RewardModel, reward_model_role_config
    from tba_jax.sampling.engine import EngineConfig
    from tba_jax.train import role_shardings

    assert jax.device_count() == 4, jax.devices()
    mesh = mesh_lib.make_mesh(jax.devices(), {"data": 2, "tensor": 2})
    placement = RolePlacement(mesh, get_config().mesh.sampler_rules)
    tokenizer = CharTokenizer.for_text()
    prompts = ["2+3=", "what is 7*6?", "x", "hello there"] * 2
    responses = ["5", "42", "", "general kenobi", "6", "41", "y", "hi"]
    out: dict = {}
    kwargs = dict(role_name="task.reward_model", fallback_tokenizer=tokenizer)
    for batch_size in (4, 3):  # rows split over data (2); 3 rows: padded to 4
        role = reward_model_role_config(preset_name="tiny", batch_size=batch_size, max_len=32)
        whole = RewardModel.from_config(role, **kwargs)
        placed = RewardModel.from_config(role, placement=placement, **kwargs)
        out[f"rm_max_diff_batch_{batch_size}"] = float(
            np.max(np.abs(placed.scores(prompts, responses) - whole.scores(prompts, responses)))
        )
    for rows in (4, 3):
        (put,) = placed.frozen.put_rows(np.zeros((rows, 5), np.int32))
        out[f"rows_{rows}_shard_rows"] = sorted(
            {shard.data.shape[0] for shard in put.addressable_shards}
        )
    w_up = placed.frozen.params["blocks"][0]["mlp"]["w_up"]  # (embed, mlp)
    out["rm_w_up_spec"] = [axis for axis in w_up.sharding.spec]
    out["rm_w_up_shard_shape"] = list(w_up.addressable_shards[0].data.shape)
    out["rm_w_up_shape"] = list(w_up.shape)
    judge_role = redteam.judge_role_config(
        kind="generative",
        template="{response} is",
        preset_name="tiny",
        max_prompt_len=24,
        batch_size=4,
    )
    whole_judge = judges.judge_from_config(judge_role, tokenizer)
    placed_judge = judges.judge_from_config(judge_role, tokenizer, placement)
    out["judge_max_diff"] = float(
        np.max(
            np.abs(
                placed_judge.toxic_logprob(prompts, responses)
                - whole_judge.toxic_logprob(prompts, responses)
            )
        )
    )
    victim_role = redteam.victim_role_config(
        template="Q: {attack}\nA:",
        preset_name="tiny",
        num_responses=2,
        max_prompt_len=24,
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        batch_size=3,
    )
    victim = redteam.Victim.from_config(victim_role, tokenizer, placement)
    answers = victim.respond(prompts[:3])  # 6 rows: 2 batches of 3, each padded to 4
    out["victim_answers"] = [len(per_attack) for per_attack in answers]
    whole_victim = redteam.Victim.from_config(victim_role, tokenizer)
    out["victim_same_answers"] = whole_victim.respond(prompts[:3]) == answers
    # through the slot engine: 4 slots split over data (2), each attack prefilled once for
    # its 2 answers; the same answers on split params as on one device (the same keys)
    engine_role = victim_role.copy_and_resolve_references()
    engine_role.batch_size = 4
    engine = EngineConfig(slots=1, min_width=1)
    placed_engine = redteam.Victim.from_config(engine_role, tokenizer, placement, engine)
    engine_answers = placed_engine.respond(prompts[:3])
    out["victim_engine_answers"] = [len(per_attack) for per_attack in engine_answers]
    whole_engine = redteam.Victim.from_config(engine_role, tokenizer, engine=engine)
    out["victim_engine_same_answers"] = whole_engine.respond(prompts[:3]) == engine_answers
    out["victim_params_devices"] = len(_all_device_ids(victim.frozen.params))
    with tempfile.TemporaryDirectory(prefix="bert_judge_") as bert_folder:  # 61 MB
        _write_bert_judge(bert_folder)
        for batch_size in (4, 3):  # 3 rows a batch: padded to 4
            bert_role = redteam.judge_role_config(
                kind="classifier",
                template="{attack} {response}",
                toxic_label="toxic",
                max_prompt_len=64,
                batch_size=batch_size,
            )
            bert_role.hf_path = bert_folder
            whole_bert = judges.judge_from_config(bert_role, tokenizer)
            placed_bert = judges.judge_from_config(bert_role, tokenizer, placement)
            out[f"bert_judge_max_diff_batch_{batch_size}"] = float(
                np.max(
                    np.abs(
                        placed_bert.toxic_logprob(prompts, responses)
                        - whole_bert.toxic_logprob(prompts, responses)
                    )
                )
            )
    bert_params = placed_bert.classifier.encoder.params
    out["bert_mlp_in_spec"] = list(bert_params["layers"]["mlp_in"]["kernel"].sharding.spec)
    out["bert_query_shard_shape"] = list(
        bert_params["layers"]["query"]["kernel"].addressable_shards[0].data.shape
    )
    out["bert_whole_devices"] = len(_all_device_ids(whole_bert.classifier.encoder.params))
    # the red-team diversity metric's sentence embedder (MiniLM) goes there too
    from tba_jax.rewards.diversity import load_sentence_embedder

    texts = [f"attack number {i}" for i in range(5)]  # batches of 3: 3 and 2, padded to 4
    placed_embedder = load_sentence_embedder("", placement)
    whole_embedder = load_sentence_embedder("")
    out["embedder_max_diff"] = float(
        np.max(
            np.abs(
                placed_embedder.embed(texts, batch_size=3)
                - whole_embedder.embed(texts, batch_size=3)
            )
        )
    )
    out["embedder_devices"] = len(_all_device_ids(placed_embedder.params))
    # micro's one KV head cannot be split over tensor (2): a ConfigError naming the role,
    # and the same for the policy's shardings
    micro_role = reward_model_role_config(preset_name="micro", batch_size=4, max_len=32)
    try:
        RewardModel.from_config(micro_role, placement=placement, **kwargs)
    except ConfigError as error:
        out["role_split_error"] = str(error)
    # evaluate.py's placement: the run's tensor size, data taking the other devices
    config = get_config()
    config.mesh.sampler_axes = {"data": 1, "fsdp": 1, "tensor": 2}
    out["evaluation_mesh"] = dict(over_all_devices(config).mesh.shape)
    config.mesh.sampler_axes = {"data": 2, "fsdp": 1, "tensor": 2}
    meshes = mesh_lib.make_role_meshes(1.0, True, config.mesh.sampler_axes, {"fsdp": -1})
    model, params = init_model(preset("micro", vocab_size=16), 0)
    try:
        role_shardings(config, model, _abstract(params), meshes)
    except ConfigError as error:
        out["policy_split_error"] = str(error)
    return out


def _kernel_calls(traced) -> dict:
    """How many Pallas kernels a traced program runs, how many of them inside a shard_map
    (run per shard), and their names, found by walking its jaxpr and every jaxpr nested
    in it."""
    counts = {"pallas": 0, "in_shard_map": 0, "names": []}

    def nested(value):
        if isinstance(value, jax.extend.core.ClosedJaxpr):
            yield value.jaxpr
        elif isinstance(value, jax.extend.core.Jaxpr):
            yield value
        elif isinstance(value, tuple | list):
            for item in value:
                yield from nested(item)

    def walk(jaxpr, under_shard_map: bool) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "pallas_call":
                counts["pallas"] += 1
                counts["in_shard_map"] += under_shard_map
                kernel_name = eqn.params["name"]
                if kernel_name not in counts["names"]:
                    counts["names"].append(kernel_name)
                continue
            for value in eqn.params.values():
                for inner in nested(value):
                    walk(inner, under_shard_map or name == "shard_map")

    walk(traced.jaxpr.jaxpr, False)
    return counts


def check_kernels() -> dict:
    """4 devices: the model's Pallas kernels split over a mesh (`models.kernel_mesh`). A
    (data 2, tensor 2) sampler mesh decodes greedily through the attention-input, decode
    attention, gated MLP and output projection kernels as the plain model does on one
    device (heads of 32: the attention-input kernel's least); a (fsdp 2,
    tensor 2) learner mesh takes a TB step through splash attention as the plain model
    does on one device.
    Each kernel runs under a shard_map on the mesh (XLA refuses to split a Mosaic kernel,
    and gathers a Triton one's inputs onto every device) and as it is on one device."""
    import dataclasses

    from tba_jax.models import ModelConfig
    from tba_jax.sampling.generate import SamplingConfig, make_generate_fn

    assert jax.device_count() == 4, jax.devices()
    config = get_config()
    plain = ModelConfig(
        vocab_size=16, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=32,
        max_seq_len=32, init_std=0.5,
    )  # fmt: skip
    decoder = dataclasses.replace(plain, head_dim=32, qkv_bias=True)
    kernels = dataclasses.replace(
        decoder,
        decode_attention="pallas",
        decode_mlp="pallas",
        decode_mlp_kernel="16:16:16:2:2",
        decode_projection="pallas",  # the down projection's 32 split over tensor: 2 × 16
        decode_projection_kernel="16:16:16:2:2:2",
        decode_qkv="pallas",  # one KV head and its 2 query heads a device
        decode_qkv_kernel="16:16:2:2",
    )
    model, params = init_model(decoder, 0)
    kernel_model, _ = init_model(kernels, 0)
    one_device = mesh_lib.make_mesh(jax.devices()[:1], {})
    sampler = mesh_lib.make_mesh(jax.devices(), {"data": 2, "tensor": 2})
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 16, size=(5, 4)).astype(np.int32)  # 5 rows: padded to 6
    mask = np.arange(4)[None] >= np.asarray([[0], [2], [1], [0], [3]])
    prompts = np.where(mask, prompts, 0).astype(np.int32)
    greedy = SamplingConfig(max_new_tokens=6, greedy=True)

    def on(mesh, tree, m=model, rules=config.mesh.sampler_rules):
        shardings = mesh_lib.param_shardings(m.logical_axes, _abstract(tree), mesh, rules)
        return jax.device_put(tree, shardings)

    def decode(m, mesh, run=True):
        """The greedy decode of `prompts` on `mesh` (`run`: else None) and the Pallas
        calls of its traced program."""
        generate = make_generate_fn(m, greedy, eos_id=2, pad_id=0)
        args = (on(mesh, params, m), *mesh_lib.split_rows(mesh, prompts, mask))
        out = jax.device_get(generate(*args, jax.random.key(0))) if run else None
        return out, _kernel_calls(generate.trace(*args, jax.random.key(0)))

    reference, _ = decode(model, one_device)
    split, split_calls = decode(kernel_model, sampler)
    _, one_device_calls = decode(kernel_model, one_device, run=False)
    # projections in one part, which add the residual in the kernel, on rows split 4 ways
    one_part = dataclasses.replace(kernels, decode_projection_kernel="16:16:16:1:2:2")
    one_part_model, _ = init_model(one_part, 0)
    rows_split = mesh_lib.make_mesh(jax.devices(), {"data": 4})
    one_part_split, one_part_calls = decode(one_part_model, rows_split)
    rows = len(prompts)
    sampler_result = {
        "same_tokens": bool((split.tokens[:rows] == reference.tokens).all()),
        "max_logp_diff": float(np.max(np.abs(split.token_logp[:rows] - reference.token_logp))),
        "calls": split_calls,
        "one_device_calls": one_device_calls,
        "one_part_same_tokens": bool((one_part_split.tokens[:rows] == reference.tokens).all()),
        "one_part_max_logp_diff": float(
            np.max(np.abs(one_part_split.token_logp[:rows] - reference.token_logp))
        ),
        "one_part_calls": one_part_calls,
    }

    splash = dataclasses.replace(plain, attention="splash")
    splash_model, _ = init_model(splash, 0)
    learner_mesh = mesh_lib.make_mesh(jax.devices(), {"fsdp": 2, "tensor": 2})
    batch = _random_batch(np.random.default_rng(1), 2, 4, 5, 6, vocab=16)
    rules = config.mesh.learner_rules
    plain_model, plain_params = init_model(plain, 0)
    ref_state, ref_metrics, *_ = _run_train_step(
        plain_model, plain_params, batch, one_device, rules, 4
    )
    state, metrics, placed, _, step = _run_train_step(
        splash_model, plain_params, batch, learner_mesh, rules, 4
    )
    return {
        "sampler": sampler_result,
        "learner": {
            "max_param_diff": _max_diff(state.params, ref_state.params),
            "loss_ratio": float(metrics["loss"]) / float(ref_metrics["loss"]),
            "grad_norm_ratio": float(metrics["grad_norm"]) / float(ref_metrics["grad_norm"]),
            "calls": _kernel_calls(step.trace(state, placed)),
        },
    }


def check_uneven_split_refused() -> dict:
    """4 devices: a run whose rules split the policy's one KV head over a tensor axis of 2
    is refused by `check_run`, before its task is built, with the workdir left empty."""
    from tba_jax.config_lib import ConfigError
    from tba_jax.train import check_run

    config = get_config("smoke,mesh.colocate=True,mesh.learner_axes.fsdp=2")
    config.mesh.learner_axes.tensor = 2
    with tempfile.TemporaryDirectory() as workdir:
        try:
            check_run(config, workdir)
            error = None
        except ConfigError as refused:
            error = str(refused)
        return {"error": error, "workdir_entries": sorted(os.listdir(workdir))}


def check_fsdp_and_roles() -> dict:
    """4 devices: check_fsdp's observations, check_roles's under "roles",
    check_kernels's under "kernels" and check_uneven_split_refused's under "refused" (one
    process start for all four)."""
    return {
        **check_fsdp(),
        "roles": check_roles(),
        "kernels": check_kernels(),
        "refused": check_uneven_split_refused(),
    }


def check_publish_and_engine() -> dict:
    """2 devices: check_publish's observations, check_engine's under "engine" and
    check_data_split_search's under "search" (one process start for all three)."""
    return {**check_publish(), "engine": check_engine(), "search": check_data_split_search()}


CHECKS = {"publish": check_publish_and_engine, "fsdp": check_fsdp_and_roles, "train": check_train}


def main(argv: list[str]) -> None:
    result = CHECKS[argv[1]](*argv[2:])
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv)
