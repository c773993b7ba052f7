"""tba_jax.hlo_traffic: bytes read and written per kernel and per loop iteration, from
optimized HLO, checked against hand counts: on small HLO modules written out here (the
text XLA prints) and on programs this machine's XLA compiles; and
benchmarks/static_profile.py at micro size."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from support import REPO_ROOT, run_repo_script

from tba_jax import hlo_traffic, roofline
from tba_jax.models import preset

# A decode-like loop in optimized-HLO form: each iteration reads one row of an [8, 1024]
# f32 table with a dynamic slice, writes one row into an [8, 1024] cache in place, and runs
# an inner loop of known trip count 3 whose body adds two [1024] vectors.
LOOP_MODULE = """
HloModule decode_like, entry_computation_layout={()->f32[8,1024]{1,0}}

%fused_slice (param_0: f32[8,1024], param_1: s32[]) -> f32[1,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %row = f32[1,1024] dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={1,1024}
}

%fused_update (param_0.1: f32[8,1024], param_1.1: f32[1,1024], param_2: s32[]) -> f32[8,1024] {
  %param_0.1 = f32[8,1024]{1,0} parameter(0)
  %bitcast.1 = f32[8,1024]{1,0} bitcast(%param_0.1)
  %param_1.1 = f32[1,1024]{1,0} parameter(1)
  %twice = f32[1,1024]{1,0} add(%param_1.1, %param_1.1)
  %param_2 = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  ROOT %written = f32[8,1024]{1,0} dynamic-update-slice(%bitcast.1, %twice, %param_2, %zero.1)
}

%fused_add (param_0.2: f32[1024], param_1.2: f32[1024]) -> f32[1024] {
  %param_0.2 = f32[1024]{0} parameter(0)
  %param_1.2 = f32[1024]{0} parameter(1)
  ROOT %sum = f32[1024]{0} add(%param_0.2, %param_1.2)
}

%ib (inner: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %inner = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%inner), index=0
  %v = f32[1024]{0} get-tuple-element(%inner), index=1
  %added = f32[1024]{0} fusion(%v, %v), kind=kLoop, calls=%fused_add
  ROOT %next = (s32[], f32[1024]{0}) tuple(%i, %added)
}

%ic (inner.1: (s32[], f32[1024])) -> pred[] {
  %inner.1 = (s32[], f32[1024]{0}) parameter(0)
  ROOT %true = pred[] constant(true)
}

%outer_body (carry: (s32[], f32[8,1024], f32[8,1024])) -> (s32[], f32[8,1024], f32[8,1024]) {
  %carry = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) parameter(0)
  %step = s32[] get-tuple-element(%carry), index=0
  %table = f32[8,1024]{1,0} get-tuple-element(%carry), index=1
  %cache = f32[8,1024]{1,0} get-tuple-element(%carry), index=2
  %row.1 = f32[1,1024]{1,0} fusion(%table, %step), kind=kLoop, calls=%fused_slice
  %cache.1 = f32[8,1024]{1,0} fusion(%cache, %row.1, %step), kind=kLoop, calls=%fused_update
  %flat = f32[1024]{0} bitcast(%row.1)
  %start = (s32[], f32[1024]{0}) tuple(%step, %flat)
  %inner_loop = (s32[], f32[1024]) while(%start), condition=%ic, body=%ib, TRIP_COUNT
  ROOT %next.1 = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) tuple(%step, %table, %cache.1)
}

%outer_cond (carry.1: (s32[], f32[8,1024], f32[8,1024])) -> pred[] {
  %carry.1 = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) parameter(0)
  ROOT %go = pred[] constant(true)
}

ENTRY %main () -> f32[8,1024] {
  %zero.2 = s32[] constant(0)
  %table.1 = f32[8,1024]{1,0} constant({...})
  %cache.2 = f32[8,1024]{1,0} constant({...})
  %init = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) tuple(%zero.2, %table.1, %cache.2)
  %loop = (s32[], f32[8,1024], f32[8,1024]) while(%init), condition=%outer_cond, body=%outer_body
  ROOT %out = f32[8,1024]{1,0} get-tuple-element(%loop), index=2
}
""".replace("TRIP_COUNT", 'backend_config={"known_trip_count":{"n":"3"}}')
ROW = 1024 * 4  # bytes of one f32 row
INDEX = 4  # bytes of the s32 step index a slice or an update reads


def test_array_bytes_sums_a_tuples_arrays_and_ignores_layouts():
    assert hlo_traffic.array_bytes("bf16[256,2,64,512]{3,2,1,0}") == 256 * 2 * 64 * 512 * 2
    assert hlo_traffic.array_bytes("(f32[4,3]{1,0}, (s32[4]{0}, pred[2]{0}))") == 48 + 16 + 2
    assert hlo_traffic.array_bytes("f32[]") == 4


def test_a_decode_like_loop_counts_slices_in_place_updates_and_nested_trips():
    program = hlo_traffic.program_traffic(LOOP_MODULE)
    (loop,) = hlo_traffic.loops_without_trip_count(program)
    accesses = {access.name: access for access in loop.accesses}
    # The slice reads one row of the table (not the table) and its index, and writes the row.
    assert (accesses["row.1"].read_bytes, accesses["row.1"].written_bytes) == (ROW + INDEX, ROW)
    assert accesses["row.1"].kind == "slice copy"
    # The update reads the row and writes it into the aliased cache: one row each way.
    assert (accesses["cache.1"].read_bytes, accesses["cache.1"].written_bytes) == (
        ROW + INDEX,
        ROW,
    )
    assert accesses["cache.1"].kind == "update in place"
    (inner,) = loop.loops
    assert inner.trip_count == 3 and inner.bytes_per_iteration() == 3 * ROW  # 2 in, 1 out
    assert loop.bytes_per_iteration() == 4 * ROW + 2 * INDEX + 3 * 3 * ROW
    assert loop.kernels_per_iteration() == 2 + 3
    assert hlo_traffic.bytes_by_kind(loop) == {
        "elementwise": 9 * ROW,
        "slice copy": 2 * ROW + INDEX,
        "update in place": 2 * ROW + INDEX,
    }
    (largest,) = hlo_traffic.largest_groups(loop, 1)
    assert (largest.kind, largest.count, largest.bytes) == ("elementwise", 3, 9 * ROW)


# The same program as newer XLA writes it (JAX 0.12 on CPU; a GPU command buffer is alike):
# the entry calls a computation that holds the while loop.
CALLED_LOOP_MODULE = (
    LOOP_MODULE.replace(
        "ENTRY %main () -> f32[8,1024] {",
        """%wrapped_loop (init.1: CARRY) -> CARRY {
  %init.1 = (s32[], f32[8,1024]{1,0}, f32[8,1024]{1,0}) parameter(0)
  ROOT %loop.1 = CARRY while(%init.1), condition=%outer_cond, body=%outer_body
}

ENTRY %main () -> f32[8,1024] {""",
    )
    .replace(
        "while(%init), condition=%outer_cond, body=%outer_body",
        'call(%init), to_apply=%wrapped_loop, frontend_attributes={xla_cpu_small_call="true"}',
    )
    .replace("CARRY", "(s32[], f32[8,1024], f32[8,1024])")
)


def test_a_loop_inside_a_called_computation_is_counted_as_if_inline():
    inline = hlo_traffic.program_traffic(LOOP_MODULE)
    called = hlo_traffic.program_traffic(CALLED_LOOP_MODULE)
    assert "call(" in CALLED_LOOP_MODULE and called.accesses == inline.accesses
    (inline_loop,) = hlo_traffic.loops_without_trip_count(inline)
    (called_loop,) = hlo_traffic.loops_without_trip_count(called)
    assert called_loop.name == "loop.1"
    assert called_loop.bytes_per_iteration() == inline_loop.bytes_per_iteration()
    assert called_loop.kernels_per_iteration() == inline_loop.kernels_per_iteration()


# A log-prob lookup as XLA fuses it: the logits are scaled and masked elementwise, then
# one id per row is gathered; only those elements are read. The scale is also written out
# whole by a second fusion, which reads every element.
GATHER_MODULE = """
HloModule lookup, entry_computation_layout={(f32[4,1000]{1,0}, s32[])->f32[4,1]{1,0}}

%fused_lookup (param_0: f32[4,1000], param_1: s32[]) -> f32[4,1] {
  %param_0 = f32[4,1000]{1,0} parameter(0)
  %half = f32[] constant(0.5)
  %halves = f32[4,1000]{1,0} broadcast(%half), dimensions={}
  %scaled = f32[4,1000]{1,0} multiply(%param_0, %halves)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %picked = f32[4,1]{1,0} dynamic-slice(%scaled, %zero, %param_1), dynamic_slice_sizes={4,1}
}

%fused_scale (param_0.1: f32[4,1000]) -> f32[4,1000] {
  %param_0.1 = f32[4,1000]{1,0} parameter(0)
  %two = f32[] constant(2)
  %twos = f32[4,1000]{1,0} broadcast(%two), dimensions={}
  ROOT %doubled = f32[4,1000]{1,0} multiply(%param_0.1, %twos)
}

ENTRY %main (logits: f32[4,1000], id: s32[]) -> (f32[4,1], f32[4,1000]) {
  %logits = f32[4,1000]{1,0} parameter(0)
  %id = s32[] parameter(1)
  %lookup = f32[4,1]{1,0} fusion(%logits, %id), kind=kLoop, calls=%fused_lookup
  %scale = f32[4,1000]{1,0} fusion(%logits), kind=kLoop, calls=%fused_scale
  ROOT %out = (f32[4,1]{1,0}, f32[4,1000]{1,0}) tuple(%lookup, %scale)
}
"""


def test_elements_sliced_out_of_elementwise_results_are_the_only_ones_read():
    accesses = {
        access.name: access for access in hlo_traffic.program_traffic(GATHER_MODULE).accesses
    }
    assert (accesses["lookup"].read_bytes, accesses["lookup"].written_bytes) == (16 + INDEX, 16)
    assert (accesses["scale"].read_bytes, accesses["scale"].written_bytes) == (16000, 16000)


# A per-row cache write as XLA's GPU backend fuses it (the slot engine's rows sit at
# different offsets): a scatter into the cache, which it updates in place.
SCATTER_MODULE = """
HloModule rows

%assign (old: f32[], new: f32[]) -> f32[] {
  %old = f32[] parameter(0)
  ROOT %new = f32[] parameter(1)
}

%fused_rows (param_0: f32[8,1024], param_1: s32[8,1], param_2: f32[8,1024]) -> f32[8,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  %param_1 = s32[8,1]{1,0} parameter(1)
  %param_2 = f32[8,1024]{1,0} parameter(2)
  %rows = f32[8,1,1024]{2,1,0} bitcast(%param_2)
  ROOT %written = f32[8,1024]{1,0} scatter(%param_0, %param_1, %rows), to_apply=%assign
}

ENTRY %main (cache: f32[8,1024], at: s32[8,1], new: f32[8,1024]) -> f32[8,1024] {
  %cache = f32[8,1024]{1,0} parameter(0)
  %at = s32[8,1]{1,0} parameter(1)
  %new = f32[8,1024]{1,0} parameter(2)
  ROOT %out = f32[8,1024]{1,0} fusion(%cache, %at, %new), kind=kInput, calls=%fused_rows
}
"""


def test_a_scatter_into_a_buffer_writes_the_updates_in_place():
    (access,) = hlo_traffic.program_traffic(SCATTER_MODULE).accesses
    assert access.kind == "update in place"
    assert (access.read_bytes, access.written_bytes) == (8 * INDEX + 8 * ROW, 8 * ROW)


# A Pallas-like kernel (a custom call) that reads x and writes y, and updates a [8, 1024]
# cache in place: its second output aliases its second operand.
ALIASED_CALL_MODULE = """
HloModule aliased_call, entry_computation_layout={()->f32[8,1024]{1,0}}

ENTRY %main (x: f32[1024], cache: f32[8,1024]) -> f32[8,1024] {
  %x = f32[1024]{0} parameter(0)
  %cache = f32[8,1024]{1,0} parameter(1)
  %call = (f32[1024]{0}, f32[8,1024]{1,0}) custom-call(%x, %cache), TARGET, ALIASING
  ROOT %out = f32[8,1024]{1,0} get-tuple-element(%call), index=1
}
""".replace("TARGET", 'custom_call_target="__gpu$xla.gpu.triton"')
ALIASING = "output_to_operand_aliasing={{1}: (1, {})}"


def test_a_kernel_updating_an_aliased_buffer_is_counted_without_it():
    (access,) = hlo_traffic.program_traffic(
        ALIASED_CALL_MODULE.replace("ALIASING", ALIASING)
    ).accesses
    assert (access.read_bytes, access.written_bytes) == (ROW, ROW)
    unaliased = ALIASED_CALL_MODULE.replace(", ALIASING", "")
    (access,) = hlo_traffic.program_traffic(unaliased).accesses
    assert (access.read_bytes, access.written_bytes) == (9 * ROW, 9 * ROW)


# The same call with a Triton backend config naming its Pallas kernel (as XLA writes a
# pallas_call's: metadata's op_name and scheduling_name are not the kernel's name).
NAMED_CALL_MODULE = ALIASED_CALL_MODULE.replace(
    "ALIASING",
    'metadata={op_name="jit(f)/walk/pallas_call" scheduling_name="call"}, '
    'backend_config={debug = false, grid_x = 8 : i32, name = "walk", num_warps = 4 : i32}',
)


def test_a_kernel_is_named_and_its_reads_of_chosen_operands_can_be_scaled():
    loop = hlo_traffic.program_traffic(NAMED_CALL_MODULE)
    (access,) = loop.accesses
    assert access.kernel == "walk"
    assert access.operand_read_bytes == (ROW, 8 * ROW)
    # the kernel reads half the cache (operand 1): the cache's reads halve, x's stay
    half = hlo_traffic.with_operand_reads_scaled(loop, "walk", (1,), 0.5)
    (scaled,) = half.accesses
    assert scaled.operand_read_bytes == (ROW, 4 * ROW)
    assert (scaled.read_bytes, scaled.written_bytes) == (5 * ROW, 9 * ROW)
    assert half.bytes_per_iteration() == loop.bytes_per_iteration() - 4 * ROW
    # another kernel's name leaves it as it is; XLA's own instructions have no name
    assert hlo_traffic.with_operand_reads_scaled(loop, "other", (1,), 0.5) == loop
    (xla_access, *_) = hlo_traffic.program_traffic(LOOP_MODULE).loops[0].accesses
    assert (xla_access.kernel, xla_access.operand_read_bytes) == ("", ())


def test_operand_lists_with_index_marks_name_their_operands():
    """XLA marks every fifth operand with its index (`/*index=5*/%x`)."""
    line = (
        "  %t = (f32[2]{0}, f32[2]{0}) tuple(%a, %b, %c, %d, %e, /*index=5*/%f, %g), "
        'metadata={op_name="x"}'
    )
    instruction = hlo_traffic.parse_instruction(line)
    assert instruction.operands == ("a", "b", "c", "d", "e", "f", "g")
    assert instruction.opcode == "tuple" and instruction.shape == "(f32[2]{0}, f32[2]{0})"


def test_a_module_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo_traffic.parse_module("HloModule empty\n")


def compiled_text(function, *args) -> str:
    return jax.jit(function).lower(*args).compile().as_text()


def test_a_compiled_matmul_reads_both_operands_and_writes_its_product():
    lhs, rhs = jnp.ones((64, 32)), jnp.ones((32, 16))
    program = hlo_traffic.program_traffic(compiled_text(jnp.matmul, lhs, rhs))
    assert sum(access.bytes for access in program.accesses) == (64 * 32 + 32 * 16 + 64 * 16) * 4
    assert program.flops_per_iteration() == 2 * 64 * 32 * 16
    assert "matmul" in hlo_traffic.bytes_by_kind(program)


def test_a_compiled_cache_write_in_a_decode_loop_moves_the_row_not_the_cache():
    """A while loop that stops on a runtime condition (as generate's does) and writes one
    row of a [512, 256] cache per step: a step moves a few rows, not the 512 kB cache."""

    def decode(cache, row, stop):
        def step(carry):
            index, cache = carry
            cache = jax.lax.dynamic_update_slice(cache, row[None] * index, (index, 0))
            return index + 1, cache

        return jax.lax.while_loop(lambda carry: carry[0] < stop, step, (0, cache))[1]

    cache, row = jnp.zeros((512, 256)), jnp.ones((256,))
    program = hlo_traffic.program_traffic(compiled_text(decode, cache, row, 7))
    (loop,) = hlo_traffic.loops_without_trip_count(program)
    assert 0 < loop.bytes_per_iteration() <= 4 * 256 * 4
    assert "update in place" in hlo_traffic.bytes_by_kind(loop)


MICRO = ("--shape=micro", "--vocab=64", "--dtype=float32", "--layers=2", "--top=3")
MICRO_ROWS = ("--batch=2", "--prompt=4", "--new=8")


def run_profile(*args: str):
    done = run_repo_script("benchmarks/static_profile.py", *MICRO, *args, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_decode_profile_at_micro_size_on_this_machine():
    line = run_profile(*MICRO_ROWS, "--decode_segments=2", "--param_dtype=bfloat16")
    assert line["benchmark"] == "static_profile" and line["program"] == "decode"
    assert line["target"] == "local" and line["param_dtype"] == "bfloat16"
    assert len(line["segment_step_bytes"]) == 2
    assert line["segment_step_bytes"][0] < line["segment_step_bytes"][1]  # a shorter cache
    assert line["static_step_bytes"] >= line["roofline_step_bytes"] > 0
    assert line["static_over_roofline"] == pytest.approx(
        line["static_step_bytes"] / line["roofline_step_bytes"], abs=1e-3
    )
    assert sum(line["by_kind"].values()) == line["segment_step_bytes"][1]
    assert len(line["largest"]) == 3
    assert line["attention_read_share"] == 1.0  # XLA's attention reads the whole cache


def test_slot_decode_step_writes_its_cache_in_place():
    """The slot engine writes each slot's new key at its own offset; that write must stay
    an in-place update of one position a slot: what a step copies or updates does not grow
    with the cache's length, while what it reads (attention over the cache) does."""

    def profile(new: int) -> dict:
        return run_profile("--program=slot_decode", "--batch=16", "--prompt=8", f"--new={new}")

    short, long = profile(56), profile(120)
    assert short["program"] == "slot_decode" and short["batch"] == 16
    assert sum(short["by_kind"].values()) == short["static_step_bytes"]
    assert short["roofline_step_bytes"] <= short["static_step_bytes"]

    def written(line: dict) -> int:
        return sum(line["by_kind"].get(kind, 0) for kind in ("copy", "update in place"))

    assert written(long) == written(short)
    assert long["static_step_bytes"] > short["static_step_bytes"]


def test_train_profile_at_micro_size_counts_the_model_flops_it_computes():
    """The learner step's matmul FLOPs are the model FLOPs MFU counts (the backward pass
    included), and its roofline time is at least theirs at the peak."""
    line = run_profile(
        "--program=train",
        "--prompt=4",
        "--new=4",
        "--train_prompts=2",
        "--train_k=2",
        "--microbatches=1",
    )
    assert line["program"] == "train" and line["sequences"] == 4 and line["seq_len"] == 8
    # The model FLOPs count the output head on every token, the step runs it on the
    # response's only, and the einsum attention computes full (not causal-halved) scores.
    assert 0.9 * line["model_flops"] <= line["matmul_flops"] <= 1.2 * line["model_flops"]
    assert line["roofline_seconds"] >= line["model_flops"] / roofline.H100_DENSE_BF16_FLOPS
    assert sum(line["seconds_by_kind"].values()) == pytest.approx(
        line["roofline_seconds"], rel=1e-3
    )


def test_reward_model_profile_at_micro_size_plans_the_params_and_adam_state():
    """The reward-model step: 4 pairs (8 rows) of 8 tokens; its matmuls are the model
    FLOPs of a train step on 8 rows, and its arguments hold float32 params and both Adam
    moments (12 bytes a parameter) besides the batch."""
    line = run_profile(
        "--program=reward_model", "--prompt=4", "--new=4", "--pairs=4", "--microbatches=2"
    )
    assert line["program"] == "reward_model" and line["pairs"] == 4 and line["seq_len"] == 8
    assert line["microbatches"] == 2 and line["remat"] == "none"
    scorer = preset("micro", vocab_size=64, num_layers=2, head="score", num_labels=1)
    assert line["model_flops"] == pytest.approx(
        2 * 4 * 8 * roofline.train_flops_per_token(scorer, 8)
    )
    assert 0.9 * line["model_flops"] <= line["matmul_flops"] <= 1.2 * line["model_flops"]
    assert line["argument_bytes"] >= 12 * scorer.num_params()


def test_score_profile_at_micro_size_counts_a_forward_pass():
    line = run_profile("--program=score", *MICRO_ROWS)
    assert line["program"] == "score" and line["batch"] == 2
    # The forward FLOPs count the head on every token; scoring runs it on the response's.
    assert 0.9 * line["model_flops"] <= line["matmul_flops"] <= 1.2 * line["model_flops"]
    tokens = 2 * (4 + 8)
    assert line["roofline_tokens_per_s"] == pytest.approx(tokens / line["roofline_seconds"])
    needed = line["argument_bytes"] + line["temp_bytes"] + line["new_output_bytes"]
    assert line["argument_bytes"] > 0 and line["device_gib"] == round(needed / 2**30, 2)


def cuda_plugin_installed() -> bool:
    """As `static_profile.cuda_plugin_installed` (not imported here: the skip marks are read
    as this module is collected)."""
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))


@pytest.mark.skipif(
    cuda_plugin_installed(),
    reason="JAX's CUDA plugin is installed: the H100 target compiles",
)
def test_the_h100_target_without_the_cuda_plugin_says_what_to_install():
    done = run_repo_script("benchmarks/static_profile.py", *MICRO, "--target=h100", timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    message = done.stderr.strip().splitlines()[-1]
    assert f"pip install jax-cuda12-plugin=={jax.__version__}" in message


def test_libdevice_is_found_under_cuda_root(tmp_path, monkeypatch):
    from benchmarks import static_profile

    monkeypatch.setenv("CUDA_ROOT", str(tmp_path))
    assert tmp_path not in static_profile.cuda_roots_with_libdevice()
    (tmp_path / static_profile.LIBDEVICE).parent.mkdir(parents=True)
    (tmp_path / static_profile.LIBDEVICE).write_bytes(b"")
    assert tmp_path in static_profile.cuda_roots_with_libdevice()


def test_compiling_for_this_machines_device_sets_no_abstract_mesh():
    from benchmarks import static_profile

    with static_profile.compiling_for(jax.devices()[0]):
        assert jax.sharding.get_abstract_mesh().empty


def run_in_a_fresh_process(snippet: str, jax_platforms: str | None) -> subprocess.CompletedProcess:
    """`python -c snippet` in the repo, with JAX_PLATFORMS set to `jax_platforms` (None:
    unset)."""
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    if jax_platforms is not None:
        env["JAX_PLATFORMS"] = jax_platforms
    return subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs JAX's CUDA plugin")
def test_the_decode_attention_kernel_is_counted_reading_each_rows_cache_to_its_length():
    """Compiled for an H100: a 2-layer qwen2.5-0.5b decode of 8 rows with the Pallas
    decode-attention kernel over a 256-slot cache (K and V 512 KB a layer, the visible
    mask 8 KB), once for 64 + 192 tokens, once for 128 + 128. The decode loops are the
    same program; their rows see 65 to 256 slots (160.5 on average) or 129 to 256
    (192.5), so their steps' bytes differ by 32 / 256 of the two layers' cache and mask."""

    def profile(prompt: int, new: int) -> dict:
        done = run_repo_script(
            "benchmarks/static_profile.py", "--target=h100", "--shape=qwen2.5-0.5b",
            "--layers=2", "--batch=8", f"--prompt={prompt}", f"--new={new}", "--top=0",
            "--decode_attention=pallas", timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    longer_responses, longer_prompts = profile(64, 192), profile(128, 128)
    assert longer_responses["attention_read_share"] == pytest.approx(160.5 / 256, abs=1e-4)
    assert longer_prompts["attention_read_share"] == pytest.approx(192.5 / 256, abs=1e-4)
    cache_and_mask = 2 * (2 * 8 * 256 * 2 * 64 * 2 + 8 * 256 * 4)
    moved = longer_prompts["static_step_bytes"] - longer_responses["static_step_bytes"]
    assert moved == pytest.approx(cache_and_mask * 32 / 256, abs=8)


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs JAX's CUDA plugin")
def test_compiling_for_a_compile_only_gpu_makes_it_the_abstract_meshs_device():
    """In a fresh process with JAX's backends kept to the CPU (as the script's main keeps
    them): a process that started the plugin as a backend first has no compile-only CUDA
    topology, which the next test covers."""
    done = run_in_a_fresh_process(
        "import jax; from benchmarks import static_profile as s; "
        "d = s.target_device('h100'); c = s.compiling_for(d); c.__enter__(); "
        "print(jax.sharding.get_abstract_mesh().abstract_device.device_kind, '|', d.device_kind)",
        jax_platforms="cpu",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "NVIDIA H100 80GB HBM3 | NVIDIA H100 80GB HBM3"


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs JAX's CUDA plugin")
def test_a_process_whose_backends_started_the_cuda_plugin_is_told_to_keep_them_to_the_cpu():
    done = run_in_a_fresh_process(
        "import jax; jax.devices(); from benchmarks import static_profile as s; "
        "s.target_device('h100')",
        jax_platforms=None,
    )
    assert done.returncode != 0
    assert "set JAX_PLATFORMS=cpu" in done.stderr and "CUDA plugin is installed" in done.stderr
