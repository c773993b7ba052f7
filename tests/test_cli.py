"""The launchers in experiments/ as a user runs them: mistakes end in one `error: ...` line,
`--help` and `--print_config` show every flag and key, the console of a run is our own
progress, and a run with the built-in char tokenizer exports to a folder transformers (and
a new run) can load. Unit tests of tba_jax.cli and tba_jax.config_keys follow."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from configs.arithmetic import get_config
from tba_jax import cli, config_keys
from tba_jax.config_lib import ConfigError, output_dir_problem
from tba_jax.models.tokenizers import CharTokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(REPO_ROOT, "experiments")
ARITHMETIC = os.path.join(REPO_ROOT, "configs", "arithmetic.py")
SMOKE = f"--config={ARITHMETIC}:smoke"
REWARD_MODEL_TINY = "--config=" + os.path.join(REPO_ROOT, "configs", "reward_model.py") + ":tiny"
REDTEAM_TINY = "--config=" + os.path.join(REPO_ROOT, "configs", "redteam_gpt2.py") + ":tiny"
CONFIG_LAUNCHERS = ("train.py", "train_reward_model.py", "sweep_searchers.py")
LAUNCHERS = (*CONFIG_LAUNCHERS, "export_hf.py", "compare_hf.py", "replay_learner.py")
MISTAKE_SECONDS = 60  # a mistake is reported before any long work (imports take most of it)
RUN_SECONDS = 300
# The smoke run's console: the data preparation notice (2 lines, first run only), the warm
# start, checkpoints, evaluation, a line per log_every steps and the summary; 175 lines before
# the library logs were quietened. The budget leaves room for a few more notices.
SMOKE_CONSOLE_LINE_BUDGET = 20
ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


def run_script(script: str, *args: str, timeout: int = MISTAKE_SECONDS):
    return subprocess.run(
        [sys.executable, os.path.join(EXPERIMENTS, script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        cwd=REPO_ROOT,
        timeout=timeout,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints; fails the test on a traceback or exit 0."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    return last


# ----------------------------------------------------------------------------------------
# A trained smoke run (shared): its console, and its export.
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("smoke_run")
    result = run_script("train.py", SMOKE, f"--workdir={workdir}", timeout=RUN_SECONDS)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


@pytest.fixture(scope="module")
def exported(smoke_run, tmp_path_factory):
    workdir, _ = smoke_run
    out = tmp_path_factory.mktemp("exported") / "hf"
    result = run_script("export_hf.py", f"--workdir={workdir}", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    return out, json.loads(result.stdout.strip().splitlines()[-1])


def test_the_console_of_a_run_is_our_progress_not_library_logs(smoke_run):
    _, result = smoke_run
    lines = result.stderr.strip().splitlines()
    assert "orbax" not in result.stderr and "checkpoint_manager" not in result.stderr
    assert "Downloading and preparing dataset" not in result.stdout + result.stderr
    assert [line for line in lines if line.startswith("Preparing the arithmetic_reasoning")]
    assert not [line for line in lines if ABSL_PREFIX.match(line)], result.stderr
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 2/4", "step 4/4"]
    assert all(" | reward " in line and " | loss " in line for line in steps)
    assert all(" | lag " in line and " samples/s" in line for line in steps)
    assert len(lines) + len(result.stdout.splitlines()) <= SMOKE_CONSOLE_LINE_BUDGET, lines


def test_a_char_tokenizer_run_exports_a_folder_transformers_loads(smoke_run, exported):
    transformers = pytest.importorskip("transformers")
    from tba_jax.models.hf_tokenizer import HFTokenizer

    out, summary = exported
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(summary["files"])
    char = CharTokenizer.for_arithmetic(get_config("smoke").task.ops)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = HFTokenizer.from_pretrained(str(out))
    for text in ("7+5-3=", "12,9>9"):
        ids = char.encode(text)
        assert theirs(text)["input_ids"] == ours.encode(text) == ids
        framed = char.encode(text, add_bos=True, add_eos=True)
        assert theirs.decode(framed, skip_special_tokens=True) == ours.decode(framed) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.vocab_size == char.vocab_size == len(theirs)
    token_ids = (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id)
    assert token_ids == (char.bos_id, char.eos_id, char.pad_id)


def test_an_exported_folder_starts_a_new_run(exported, tmp_path):
    out, _ = exported
    variant = f"smoke,hf_path={out},warm_start.steps=0,mode=sync,steps=1"
    result = run_script(
        "train.py", f"--config={ARITHMETIC}:{variant}", f"--workdir={tmp_path}", timeout=RUN_SECONDS
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["learner_steps"] == 1


def test_a_folder_without_tokenizer_files_is_a_one_line_error(exported, tmp_path):
    out, _ = exported
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(out / name, weights_only / name)
    result = run_script(
        "train.py", f"{SMOKE},hf_path={weights_only}", f"--workdir={tmp_path / 'run'}"
    )
    assert "tokenizer.json" in error_line(result)


def test_export_of_a_checkpoint_folder_exports_that_step(smoke_run, exported, tmp_path):
    workdir, _ = smoke_run
    _, latest = exported
    assert latest["step"] == 4  # the latest, where no step is named
    folder = workdir / "checkpoints" / "2"
    result = run_script("export_hf.py", f"--checkpoint={folder}", f"--out={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["workdir"], summary["step"]) == (str(workdir), 2)


@pytest.mark.parametrize("flag", ["--checkpoint_step", "--step"])  # --step: its older name
def test_export_names_the_steps_there_are(smoke_run, tmp_path, flag):
    workdir, _ = smoke_run
    result = run_script("export_hf.py", f"--workdir={workdir}", f"--out={tmp_path}", f"{flag}=3")
    assert "No checkpoint for step 3" in error_line(result)
    assert "available steps: [2, 4]; pass one as --checkpoint_step," in error_line(result)


def test_evaluate_names_the_steps_there_are_and_an_unfinished_run(smoke_run, tmp_path):
    workdir, _ = smoke_run
    result = run_script("evaluate.py", f"--workdir={workdir}", "--checkpoint_step=3")
    assert "No checkpoint for step 3" in error_line(result)
    assert "available steps: [2, 4]" in error_line(result)
    # the same run as if its learner_steps were 6: evaluated, with a note that it is unfinished
    config_path = workdir / "config.json"
    saved = config_path.read_text()
    try:
        config = json.loads(saved)
        config["learner_steps"] = 6
        config_path.write_text(json.dumps(config))
        result = run_script(
            "evaluate.py", f"--workdir={workdir}", f"--out={tmp_path}/eval.json", "--ks=1"
        )
    finally:
        config_path.write_text(saved)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "is unfinished: its latest checkpoint is step 4 of 6" in result.stderr


def test_export_of_a_workdir_without_a_checkpoint(smoke_run, tmp_path):
    workdir, _ = smoke_run
    (tmp_path / "run").mkdir()
    shutil.copy(workdir / "config.json", tmp_path / "run" / "config.json")
    run, out = tmp_path / "run", tmp_path / "out"  # not inside the run: refused
    result = run_script("export_hf.py", f"--workdir={run}", f"--out={out}")
    assert "No checkpoint in workdir" in error_line(result)


def test_compare_refuses_a_tokenizer_larger_than_the_model(exported, tmp_path):
    out, _ = exported
    folder = tmp_path / "larger_tokenizer"
    shutil.copytree(out, folder)
    CharTokenizer.for_text().save_pretrained(str(folder))  # 99 ids for 18 embeddings
    line = error_line(run_script("compare_hf.py", f"--hf_path={folder}"))
    assert "has 99 ids but the model's vocabulary has only 18" in line


def test_compare_refuses_an_unsupported_model_type(exported, tmp_path):
    out, _ = exported
    folder = tmp_path / "bert"
    shutil.copytree(out, folder)
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_config, "model_type": "bert"}))
    line = error_line(run_script("compare_hf.py", f"--hf_path={folder}"))
    assert "model_type 'bert'" in line and "is not supported" in line


# ----------------------------------------------------------------------------------------
# Mistakes on the command line, before any work.
# ----------------------------------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("script", CONFIG_LAUNCHERS)
def test_a_config_file_that_does_not_exist(script):
    line = error_line(run_script(script, "--config=configs/no_such.py:smoke"))
    assert line.startswith("error: --config=configs/no_such.py:smoke: there is no config file")


@pytest.mark.parametrize(
    "script, args, flag",
    [
        ("train.py", [SMOKE], "--workdir"),
        ("train_reward_model.py", [REWARD_MODEL_TINY], "--workdir"),
        ("sweep_searchers.py", [REDTEAM_TINY], "--workdir_root"),
        ("export_hf.py", ["--workdir=/nowhere"], "--out"),
    ],
)
def test_an_output_folder_under_a_file(script, args, flag, a_file):
    result = run_script(script, *args, f"{flag}={a_file}/run")
    line = error_line(result)
    assert line == (
        f"error: {flag}={a_file}/run cannot be created: {a_file} is a file; "
        "pass a folder you can write to."
    )


def test_a_bucket_url_as_workdir_is_refused_before_any_work():
    # it would be written as a local folder named 'gs:' (checkpoints through orbax's own
    # filesystem layer, the rest through open()): never where the user looks for it
    result = run_script("train.py", SMOKE, "--workdir=gs://a-bucket/runs/demo")
    assert error_line(result).startswith(
        "error: --workdir=gs://a-bucket/runs/demo is a URL, not a folder: runs write their "
        "files through the filesystem, so mount the gs:// bucket (e.g. with gcsfuse)"
    )
    assert not os.path.exists(os.path.join(REPO_ROOT, "gs:"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_workdir_in_a_read_only_folder(tmp_path):
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    line = error_line(run_script("train.py", SMOKE, f"--workdir={read_only}/run"))
    assert "is not writable" in line
    assert not (read_only / "run").exists()


def test_a_misspelt_override_names_the_nearest_key(tmp_path):
    result = run_script(
        "train.py", SMOKE, "--config.optim.learning_rat=1e-4", f"--workdir={tmp_path}"
    )
    assert error_line(result) == (
        "error: unknown config key 'optim.learning_rat'; did you mean 'optim.learning_rate'?"
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_misspelt_variant_key_is_one_line(tmp_path):
    result = run_script("train.py", f"{SMOKE},learning_rat=1", f"--workdir={tmp_path}")
    assert "'learning_rat'" in error_line(result)
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_misspelt_variant_key_names_the_nearest_key():
    with pytest.raises(ConfigError, match=r"did you mean 'optim\.learning_rate'\?"):
        get_config("smoke,learning_rat=1")


def test_keys_a_run_does_not_read_are_named_before_it_starts(tmp_path):
    # a sync run given another method's option, a slot-engine knob and k (async only);
    # then a config error, so that nothing trains
    result = run_script(
        "train.py",
        f"{SMOKE},mode=sync,k=4,loss.grpo.clip_epsilon=0.1",
        "--config.search.chunk_steps=4",
        "--config.optim.learning_rate=3e-4",
        "--config.batch.num_microbatches=3",
        f"--workdir={tmp_path / 'run'}",
    )
    assert "does not divide into batch.num_microbatches=3" in error_line(result)
    warnings = [line for line in result.stderr.splitlines() if "changes nothing" in line]
    assert warnings == [
        "warning: loss.grpo.clip_epsilon=0.1 changes nothing in this run: only method=grpo reads "
        "loss.grpo.* (this run: method=tb).",
        "warning: search.chunk_steps=4 changes nothing in this run: only search.engine=slots "
        "reads it (this run: search.engine=batch).",
        "warning: sync_period=4 changes nothing in this run: only mode=async reads it (this run: "
        "mode=sync).",
    ]
    assert not (tmp_path / "run").exists()


def test_changed_keys_are_the_command_lines_not_a_named_variants():
    argv = ["prog", f"{SMOKE},k=4,method=rloo", "--config.loss.grpo.clip_epsilon=0.1"]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
    # smoke's own settings (steps, lengths, ...) are the config's; k is a shortcut
    assert cli.changed_keys(argv, "config", flag_values) == [
        "loss.grpo.clip_epsilon",
        "method",
        "sync_period",
    ]
    assert cli.changed_keys(["prog"], "config", flag_values) == []


def test_the_workdir_is_required_unless_printing_the_config():
    assert error_line(run_script("train.py", SMOKE)) == "error: --workdir is required; see --help."


def test_an_override_without_its_config_file_says_to_name_the_file(tmp_path):
    line = error_line(
        run_script("evaluate.py", f"--workdir={tmp_path}", "--config.task.num_test=3")
    )
    assert "Unknown command line flag 'config.task.num_test'" in line
    assert "name the file too (--config=configs/<file>.py[:variant]" in line


def test_export_of_an_empty_workdir(tmp_path):
    line = error_line(run_script("export_hf.py", f"--workdir={tmp_path}", f"--out={tmp_path}/o"))
    assert "is not the workdir of a tba_jax training run" in line


# ----------------------------------------------------------------------------------------
# Finding a setting: --help and --print_config.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", LAUNCHERS)
def test_help_exits_0_and_shows_the_flags(script):
    result = run_script(script, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--verbosity" in result.stdout
    if script in CONFIG_LAUNCHERS:
        assert "--config" in result.stdout and "--[no]print_config" in result.stdout


def test_short_help_exits_0():
    assert run_script("train.py", "-h").returncode == 0


def test_importing_every_launcher_and_benchmark_defines_no_flag():
    """A notebook or a test imports a script for its functions: the scripts define their
    flags in `define_flags()`, run only as a script, so two of them never clash."""
    scripts = [
        f"{folder}.{name[: -len('.py')]}"
        for folder in ("experiments", "benchmarks")
        for name in sorted(os.listdir(os.path.join(REPO_ROOT, folder)))
        if name.endswith(".py") and name != "__init__.py"
    ]
    for script in scripts:
        importlib.import_module(script)
    defined_by_scripts = {
        module: [flag.name for flag in module_flags]
        for module, module_flags in flags.FLAGS.flags_by_module_dict().items()
        if module.split(".")[0] in ("experiments", "benchmarks")
    }
    assert len(scripts) > 20 and defined_by_scripts == {}


def test_print_config_lists_every_key_resolved(tmp_path):
    workdir = tmp_path / "never_made"
    result = run_script(
        "train.py",
        f"{SMOKE},m=0.5",
        "--config.optim.learning_rate=3e-4",
        "--print_config",
        f"--workdir={workdir}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    printed = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    expected = config_keys.leaf_items(get_config("smoke,m=0.5"))
    assert [line.split(" = ")[0] for line in printed] == [key for key, _ in expected]
    assert "replay.recency_prob = 0.5" in printed
    assert "optim.learning_rate = 0.0003" in printed
    assert "learner_steps = 4" in printed
    assert not workdir.exists()


# ----------------------------------------------------------------------------------------
# tba_jax.config_keys and tba_jax.cli, in process.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "typed, nearest",
    [
        ("optim.learning_rat", "optim.learning_rate"),
        ("optm.learning_rate", "optim.learning_rate"),
        ("learning_rat", "optim.learning_rate"),
        ("replay.recency", "replay.recency_prob"),
        ("zzzzzz", None),
    ],
)
def test_nearest_key(typed, nearest):
    assert config_keys.nearest_key(get_config("smoke"), typed) == nearest


def test_unknown_key_message_is_one_line():
    config = get_config("smoke")
    assert config_keys.unknown_key_message(config, "seeed") == (
        "unknown config key 'seeed'; did you mean 'seed'?"
    )
    assert config_keys.unknown_key_message(config, "zzzzzz") == (
        "unknown config key 'zzzzzz'; --print_config lists every key."
    )


def test_leaf_items_are_dotted_sorted_and_keep_empty_sections():
    config = ml_collections.ConfigDict({"b": {"d": {}, "c": 1}, "a": "x"})
    assert config_keys.leaf_items(config) == [("a", "x"), ("b.c", 1), ("b.d", {})]
    assert config_keys.has_key(config, "b.c") and config_keys.has_key(config, "b")
    assert not config_keys.has_key(config, "b.e") and not config_keys.has_key(config, "a.x")


def test_output_dir_problem(tmp_path, a_file, monkeypatch):
    assert output_dir_problem(str(tmp_path / "new" / "deeper")) is None
    assert output_dir_problem(str(tmp_path)) is None
    assert os.listdir(tmp_path) == [a_file.name]  # the folder made to try it is gone
    assert output_dir_problem(str(a_file)) == "is a file, not a folder"
    assert output_dir_problem(str(a_file / "run")) == f"cannot be created: {a_file} is a file"
    assert output_dir_problem("gs://bucket/runs/demo").startswith(
        "is a URL, not a folder: runs write their files through the filesystem, so mount the "
        "gs:// bucket"
    )
    assert output_dir_problem("runs/gs:/demo") is None  # a folder named 'gs:' is a folder
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert output_dir_problem(str(tmp_path)) == "is not writable"
    assert output_dir_problem(str(tmp_path / "run")) == (
        f"cannot be created: {tmp_path} is not writable"
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_output_dir_problem_tries_the_folder_as_root_cannot_trust_os_access():
    # root's os.access says /proc is writable; making a folder there fails
    problem = output_dir_problem("/proc/tba_run")
    assert problem.startswith("cannot be created: /proc is not writable")


def log_record(pathname: str, level: int, message: str = "a message") -> logging.LogRecord:
    return logging.LogRecord("absl", level, pathname, 1, message, None, None)


def test_library_logs_pass_only_from_warning(tmp_path):
    ours = str(tmp_path / "tba_jax")
    log_filter = cli.LibraryLogFilter([ours])
    library = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
    assert log_filter.filter(log_record(f"{ours}/train.py", logging.INFO))
    assert log_filter.filter(log_record(f"{ours}/train.py", logging.DEBUG))
    assert not log_filter.filter(log_record(library, logging.INFO))
    assert log_filter.filter(log_record(library, logging.WARNING))
    assert not log_filter.filter(log_record(f"{ours}_other/x.py", logging.INFO))
    expected = cli.EXPECTED_LIBRARY_WARNINGS[0] + ": SomeConfig(...)"
    assert not log_filter.filter(log_record(library, logging.WARNING, expected))


def test_a_plugin_that_did_not_start_is_one_warning_line_not_jaxs_traceback(tmp_path):
    """JAX's record for jax[cuda12] on a machine without a GPU (its format, JAX 0.11):
    the plugin's error and what to do, in one line of ours."""
    try:
        try:
            raise RuntimeError("cudaRuntimeGetVersion(&version) failed")
        except RuntimeError as cause:
            raise RuntimeError("Unable to load CUDA. Is it installed?") from cause
    except RuntimeError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "jax._src.xla_bridge", logging.ERROR, "/site-packages/jax/_src/xla_bridge.py", 498,
        "Jax plugin configuration error: Exception when calling %s.initialize()",
        ("jax_plugins.xla_cuda12",), exc_info,
    )  # fmt: skip
    log_filter = cli.LibraryLogFilter([str(tmp_path / "tba_jax")])
    assert log_filter.filter(record)
    line = cli.OwnNoticeFormatter(log_filter).format(record)
    assert line == (
        "warning: JAX's xla_cuda12 plugin did not start (Unable to load CUDA. Is it "
        "installed?), so JAX runs without it (on the CPU if nothing else is there); set "
        "JAX_PLATFORMS=cpu to skip it, or fix the GPU's driver to use it."
    )
    # other libraries' errors keep absl's format and their tracebacks
    other = logging.LogRecord("x", logging.ERROR, "/site-packages/x.py", 1, "boom", None, exc_info)
    assert log_filter.filter(other) and "Traceback" in cli.OwnNoticeFormatter(log_filter).format(
        other
    )


def test_one_line_joins_lines():
    assert cli.one_line("a\n  b\n\nc ") == "a b c"


def test_how_a_child_ended_names_the_signal_and_the_fatal_log_line():
    """libtpu's compiler on a mesh it cannot lower: glog's fatal line, then a stack trace."""
    stderr = (
        "W1128 20:59:25.0 1 some_warning.cc:12] a warning\n"
        "F1128 20:59:25.012871 6311 all_reduce_emitter.cc:1459] Check failed: ring is OK\n"
        "*** Check failure stack trace: ***\n    @ 0x7f0 (unknown)\n"
    )
    ended, why = cli.how_a_child_ended(-6, stderr)
    assert ended == "signal SIGABRT" and why.startswith("F1128 20:59:25.012871 6311 all_reduce")
    # no fatal line: the last line of stderr (a Python error), and the exit status
    assert cli.how_a_child_ended(1, "Traceback ...\nValueError: bad\n") == (
        "exit status 1",
        "ValueError: bad",
    )
    assert cli.how_a_child_ended(3, "") == ("exit status 3", "(nothing on stderr)")
