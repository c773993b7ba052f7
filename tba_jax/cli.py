"""What the command-line launchers in experiments/ share.

- `run(main, user_errors=...)`: absl's `app.run` with these conventions: a user's mistake
  (in the flags, or one of `user_errors` raised by `main`) is ONE line, `error: ...`, on
  stderr and exit status 1; a traceback means a bug. `--help` (or `-h`) exits 0. A run
  that SIGTERM or Ctrl-C stopped (after saving) says so in one line and exits 128 + the
  signal (130, 143), so that `train && evaluate` and schedulers tell it from a finished one.
- `parse_flags(argv)`: a `--config` file that does not exist, a misspelt `--config.a.b=v`
  key (the nearest key is named) and a `ConfigError` raised by the config file each end in
  one line.
- `note_unread_keys(argv)`: a warning for each key the command line changed that the run
  does not read (`loss.grpo.*` with method=tb, a slot-engine knob with the batch engine,
  an async knob with mode=sync), which would otherwise change nothing without a word.
- `define_checkpoint_flags()`: --workdir, --checkpoint_step and --checkpoint, for the
  launchers that read one checkpoint of a run.
- `define_print_config_flag()` / `print_config(config)`: `--print_config` prints every key
  of the resolved config (after the `:variant` and `--config.x=y` overrides) and exits.
- `check_output_dir(path, flag_name)`: a folder a launcher will write can be made there;
  checked before anything is written.
- `configure_console()`: our own logs at INFO without absl's prefix, other libraries'
  (orbax, jax, TFDS) only from WARNING and no library progress bars, and JAX's traceback
  for an accelerator plugin that did not start as one `warning:` line, unless
  `--verbosity` (`-v`) is given: then absl logs everything at that level, in its own
  format.
  `configure_interactive_console()`: the same console where no launcher parses flags (a
  notebook, or a script that calls `train.train_and_evaluate` itself).

A launcher adopts these flags in its `--help` with `flags.adopt_module_key_flags(cli)`.
Each launcher (experiments/) and benchmark (benchmarks/) defines its flags in its own
`define_flags()`, which only its `if __name__ == "__main__":` calls: a notebook or a test
imports any of them for its functions, and two of them never define the same flag twice.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import jax
import ml_collections
from absl import app, flags
from absl import logging as absl_logging
from ml_collections.config_flags.config_flags import is_config_flag  # public, not re-exported

import tba_jax
from tba_jax import config_keys, config_lib, distributed
from tba_jax.checkpoint import CHECKPOINTS_SUBDIR, SIGNAL_EXIT_BASE, RunStopped
from tba_jax.config_lib import ConfigError, output_dir_problem
from tba_jax.models import PRESETS
from tba_jax.models.config import DECODE_KERNEL_KNOBS

ERROR_PREFIX = "error: "
USER_ERROR_EXIT_STATUS = 1
INTERRUPTED_EXIT_STATUS = SIGNAL_EXIT_BASE + signal.SIGINT  # 130, as shells report a Ctrl-C
SHORT_HELP_FLAG = "-h"
HELP_FLAG_PATTERN = re.compile(r"^--?(help|helpshort|helpfull|\?)(=|$)")
PRINT_CONFIG_FLAG = "print_config"
VERBOSITY_FLAG = "verbosity"  # absl's --verbosity / -v
INFO_PREFIX_FLAG = "showprefixforinfo"  # absl's: the "I0102 12:00:00.0 123 file.py:1]" prefix
# Library warnings that are expected in every run and say nothing to act on: TFDS warns
# each time a builder is given a config object, which is how tba_jax.data builders work,
# and about a dataset folder that is not prepared yet, which tba_jax.data then prepares.
EXPECTED_LIBRARY_WARNINGS = ("Using custom data configuration", "Variant folder ")
# JAX's record for a PJRT plugin (e.g. jax_plugins.xla_cuda12) whose initialize() raised,
# with the traceback: JAX then runs on the platforms it still has.
PLUGIN_ERROR_PREFIX = "Jax plugin configuration error"
VERBOSITY_HELP = (
    "absl's log level (-1 warning, 0 info, 1 debug). Unset: our progress and notices at info, "
    "other libraries' logs (orbax, jax, TFDS) from warning; set: every log at that level."
)


class UsageError(Exception):
    """A mistake in a launcher's command line; `run` prints it as one `error: ...` line."""


# --------------------------------------------------------------------------------------
# Running a launcher.
# --------------------------------------------------------------------------------------


def one_line(text: str) -> str:
    """`text` with its lines joined by spaces (an error is reported on one line)."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def how_a_child_ended(returncode: int, stderr: str) -> tuple[str, str]:
    """(how a child process that gave no result ended: "signal SIGABRT" or "exit status N";
    why: its first fatal log line (glog's "F<mmdd> ..." lines, "Check failed", as a
    compiler that ends its process writes them), else its last line of stderr). E.g.
    libtpu's compiler aborting on a mesh it cannot lower (`benchmarks/tpu_plan.py`)."""
    ended = (
        f"signal {signal.Signals(-returncode).name}"
        if returncode < 0
        else f"exit status {returncode}"
    )
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    fatal = [line for line in lines if re.match(r"F\d{4} ", line) or "Check failed" in line]
    why = fatal[0] if fatal else (lines[-1] if lines else "(nothing on stderr)")
    return ended, one_line(why)


def child_user_error(returncode: int, stderr: str) -> str | None:
    """The message of a launcher run as a child process that refused its input with its
    one error line (`exit_with_error`: status 1, `error: ...` last on stderr); None for
    any other ending."""
    lines = stderr.strip().splitlines()
    if returncode != USER_ERROR_EXIT_STATUS or not lines or not lines[-1].startswith(ERROR_PREFIX):
        return None
    return lines[-1].removeprefix(ERROR_PREFIX)


def exit_with_error(message: str) -> NoReturn:
    """Prints `error: <message>` on stderr (one line) and exits with status 1; in a run over
    several processes, every other process ends with the same message."""
    if distributed.is_initialized():
        distributed.fail_all(one_line(message), USER_ERROR_EXIT_STATUS)
    print(ERROR_PREFIX + one_line(message), file=sys.stderr)
    sys.exit(USER_ERROR_EXIT_STATUS)


def run(
    main: Callable[[list[str]], Any], *, user_errors: Sequence[type[BaseException]] = ()
) -> None:
    """`app.run(main)` for a launcher: flags parsed by `parse_flags`, the console set up by
    `configure_console`, and a `UsageError`, a `ConfigError` or one of `user_errors` from
    `main` printed as one line. Ctrl-C ends with a one-line notice and status 130; a run
    that a signal stopped after saving (`RunStopped`) with 128 + the signal."""
    caught = (UsageError, ConfigError, *user_errors)

    def main_with_conventions(argv: list[str]) -> Any:
        configure_console()
        try:
            return main(argv)
        except caught as error:
            exit_with_error(str(error))
        except RunStopped as stopped:
            print(
                f"{stopped.reason}: stopped and saved; rerun the same command to go on.",
                file=sys.stderr,
            )
            sys.exit(stopped.exit_status)
        except KeyboardInterrupt:
            print("interrupted (Ctrl-C).", file=sys.stderr)
            sys.exit(INTERRUPTED_EXIT_STATUS)
        except Exception as error:
            if not distributed.is_initialized():
                raise
            traceback.print_exc()  # a bug: shown here, and every other process stops
            distributed.fail_all(f"{type(error).__name__}: {one_line(str(error))}")

    app.run(main_with_conventions, flags_parser=parse_flags)


def required(holder: flags.FlagHolder | flags.Flag) -> Any:
    """The value of a flag the launcher cannot run without (UsageError when it is unset)."""
    if holder.value is None:
        raise UsageError(f"--{holder.name} is required; see --help.")
    return holder.value


# --------------------------------------------------------------------------------------
# Parsing the flags.
# --------------------------------------------------------------------------------------


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parser, with a user's mistake reported in one line instead of a
    traceback, and `--help` / `-h` exiting 0. Use as `app.run(main, flags_parser=...)`."""
    argv = ["--help" if arg == SHORT_HELP_FLAG else arg for arg in argv]
    check_config_files_exist(argv)
    try:
        return flags.FLAGS(argv)
    except SystemExit:
        if asks_for_help(argv):  # absl exits 1 after printing the help it was asked for
            sys.exit(0)
        raise
    except flags.Error as error:
        exit_with_error(flag_error_message(error) + override_hint(error))
    except (AttributeError, KeyError):
        # ml_collections raises these for a `--config.a.b=v` key the config does not have.
        message = unknown_override_message(argv)
        if message is None:
            raise
        exit_with_error(message)


def asks_for_help(argv: Sequence[str]) -> bool:
    return any(HELP_FLAG_PATTERN.match(arg) for arg in argv[1:])


def flag_error_message(error: flags.Error) -> str:
    """absl's message; for a ConfigError raised inside a config file's get_config (absl
    hands it over as the text of a traceback), that error's own message."""
    found = re.search(rf"{ConfigError.__name__}: (.*)", str(error))
    return found.group(1) if found else str(error)


def override_hint(error: flags.Error) -> str:
    """For `--config.a.b=v` given without `--config` (which a tool reading a run's own
    config.json leaves optional): that an override needs the config file named."""
    if not isinstance(error, flags.UnrecognizedFlagError):
        return ""
    name = error.flagname
    for config_flag in config_flag_names():
        if name.startswith(config_flag + "."):
            return (
                f"; --{config_flag}.* overrides change a config file's keys, so name the file "
                f"too (--{config_flag}=configs/<file>.py[:variant] --{name}=...)"
            )
    return ""


def execution_flags(flag: Callable[[str], Any]) -> dict:
    """A benchmark's execution-knob flags as `ModelConfig` fields; `flag(name)` reads the
    flag `--name` (argparse's or absl's). `--scan_decode` scans the stacked layers, so it
    implies `scan_layers`."""
    return dict(
        scan_layers=flag("scan_layers") or flag("scan_decode"),
        scan_decode=flag("scan_decode"),
        remat=flag("remat"),
        attention=flag("attention"),
        **{
            name: flag(name)
            for kernel in DECODE_KERNEL_KNOBS
            for name in (kernel.knob, kernel.settings_key)
        },
        logprob_chunk=flag("logprob_chunk"),
    )


def define_decode_kernel_flags() -> None:
    """A benchmark's absl flags for the decode kernels' knobs (`DECODE_KERNEL_KNOBS`),
    named as the model's fields (`--decode_attention`, `--decode_kernel`, ...) and read by
    those names (`execution_flags`, `flags.FLAGS`)."""
    for kernel in DECODE_KERNEL_KNOBS:
        flags.DEFINE_enum(kernel.knob, "same", list(kernel.choices), f"model.{kernel.knob}.")
        spec = ":".join(kernel.settings_type._fields)
        flags.DEFINE_string(kernel.settings_key, "", f"model.{kernel.settings_key} ({spec}).")


def add_decode_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """`define_decode_kernel_flags` for a benchmark that parses with argparse."""
    for kernel in DECODE_KERNEL_KNOBS:
        parser.add_argument(
            f"--{kernel.knob}", default="same", choices=kernel.choices, help=f"model.{kernel.knob}"
        )
        spec = ":".join(kernel.settings_type._fields)
        parser.add_argument(
            f"--{kernel.settings_key}", default="", help=f"model.{kernel.settings_key} ({spec})"
        )


def check_cudnn_backend(flag: str, instead: str) -> None:
    """UsageError where JAX's platform here is no GPU, for a benchmark's `flag` (e.g.
    "--attention=cudnn") that asks for cuDNN's attention; `instead` says what to pass."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise UsageError(
            f"{flag} needs a GPU with cuDNN, and JAX's platform here is {backend}; {instead}"
        )


def check_preset_flags(shape: str, vocab: int | None) -> None:
    """UsageError for a benchmark's `--shape` that is no model preset, or a preset without
    a vocabulary size given no `--vocab`."""
    if shape not in PRESETS:
        raise UsageError(f"--shape={shape}: choose one of {sorted(PRESETS)}.")
    if vocab is None and "vocab_size" not in PRESETS[shape]:
        raise UsageError(
            f"--shape={shape} is a preset without a vocabulary size; pass --vocab=N "
            "(e.g. --vocab=32000)."
        )


def config_flag_names() -> list[str]:
    """The names of the `DEFINE_config_file` flags defined (e.g. ["config"])."""
    names = {flags.FLAGS[name].name for name in flags.FLAGS}
    return sorted(name for name in names if is_config_flag(flags.FLAGS[name]))


def flag_argument(argv: Sequence[str], name: str) -> str | None:
    """The last value given to `--name` in `argv` (`--name=v` or `--name v`), or None."""
    value = None
    for index, arg in enumerate(argv[1:], 1):
        for spelling in (f"--{name}", f"-{name}"):
            if arg.startswith(spelling + "="):
                value = arg[len(spelling) + 1 :]
            elif arg == spelling and index + 1 < len(argv):
                value = argv[index + 1]
    return value


def override_keys(argv: Sequence[str], name: str) -> list[str]:
    """The keys of the `--name.a.b=v` overrides in `argv`, e.g. ["a.b"]."""
    pattern = re.compile(rf"^--?(?:no)?{re.escape(name)}\.([^=]+)")
    return [found.group(1) for found in map(pattern.match, argv[1:]) if found]


def check_config_files_exist(argv: Sequence[str]) -> None:
    """Exits with one line when a `--config=path[:variant]` names no file (ml_collections
    would otherwise fail later with two tracebacks)."""
    for name in config_flag_names():
        argument = flag_argument(argv, name)
        if argument is None:
            continue
        path = argument.split(":", 1)[0]
        if not os.path.isfile(path):
            exit_with_error(
                f"--{name}={argument}: there is no config file {path!r} (from {os.getcwd()}); "
                "pass the path of one, e.g. configs/arithmetic.py."
            )


def unknown_override_message(argv: Sequence[str]) -> str | None:
    """The one-line error for the first `--config.a.b=v` override whose key the config does
    not have, naming the nearest key; None when every override's key exists."""
    for name in config_flag_names():
        argument = flag_argument(argv, name)
        if argument is None:
            continue
        config = flags.FLAGS[name].parser.parse(argument)  # the file again, no overrides
        for key in override_keys(argv, name):
            if not config_keys.has_key(config, key):
                return config_keys.unknown_key_message(config, key)
    return None


def changed_keys(
    argv: Sequence[str], name: str, flag_values: flags.FlagValues = flags.FLAGS
) -> list[str]:
    """The keys of the `--name` config whose value the command line changed: by a
    `--name.a.b=v` override or by a `key=value` item of its `:variant` (shortcuts such as
    `k=4` included). A named variant's settings (`tiny`, `smoke`) are the config file's
    own and are not counted."""
    argument = flag_argument(argv, name)
    if argument is None:
        return []
    path, _, variant = argument.partition(":")
    named, _ = config_lib.parse_variant(variant)
    config_flag = flag_values[name]
    baseline = config_flag.parser.parse(f"{path}:{','.join(named)}" if named else path)
    before = dict(config_keys.leaf_items(baseline))
    return [
        key
        for key, value in config_keys.leaf_items(config_flag.value)
        if key != "variant" and (key not in before or before[key] != value)
    ]


def note_unread_keys(
    argv: Sequence[str], name: str = "config", flag_values: flags.FlagValues = flags.FLAGS
) -> None:
    """A warning (from process 0) for each key the command line changed that the run does
    not read (`config_lib.unread_key_reason`): another method's options, the slot engine's
    knobs with the batch engine, an async knob in a sync run."""
    if distributed.is_initialized() and jax.process_index() != 0:
        return
    config = flag_values[name].value
    for key in changed_keys(argv, name, flag_values):
        reason = config_lib.unread_key_reason(config, key)
        if reason:
            value = config_keys.lookup(config, key)[1]
            absl_logging.warning("%s=%r changes nothing in this run: %s.", key, value, reason)


# --------------------------------------------------------------------------------------
# --print_config.
# --------------------------------------------------------------------------------------


def define_print_config_flag() -> flags.FlagHolder:
    """--print_config, for a launcher with a --config flag."""
    return flags.DEFINE_bool(
        PRINT_CONFIG_FLAG,
        False,
        "Print every key of the resolved config with its value (after the :variant and "
        "--config.key=value overrides) and exit without running.",
    )


def define_checkpoint_flags() -> None:
    """--workdir, --checkpoint_step and --checkpoint, for a launcher that reads one checkpoint
    of a training run (evaluate.py, export_hf.py; `runs.run_and_step` resolves them)."""
    flags.DEFINE_string("workdir", None, "The training run's workdir.")
    flags.DEFINE_integer("checkpoint_step", None, "The checkpoint's step; default: the latest.")
    flags.DEFINE_string(
        "checkpoint",
        None,
        f"A checkpoint folder, <workdir>/{CHECKPOINTS_SUBDIR}/<step>: instead of --workdir and "
        "--checkpoint_step.",
    )


def config_lines(config: ml_collections.ConfigDict) -> list[str]:
    """`key = value` for every key of `config`, sorted, keys dotted as overrides spell them."""
    resolved = config.copy_and_resolve_references()
    return [f"{key} = {value!r}" for key, value in config_keys.leaf_items(resolved)]


def print_config(config: ml_collections.ConfigDict, source: str | None = None) -> None:
    """Prints `config_lines(config)` on stdout, after a comment naming the config."""
    described = f"{source}, resolved" if source else "resolved config"
    print(f"# {described} (change a key with --config.<key>=<value>)")
    print("\n".join(config_lines(config)))


# --------------------------------------------------------------------------------------
# Output folders.
# --------------------------------------------------------------------------------------


def check_output_dir(path: str, flag_name: str) -> None:
    """UsageError when the folder given as `--flag_name` cannot be made or written."""
    problem = output_dir_problem(path)
    if problem:
        raise UsageError(f"--{flag_name}={path} {problem}; pass a folder you can write to.")


# --------------------------------------------------------------------------------------
# The console.
# --------------------------------------------------------------------------------------


def own_source_roots() -> tuple[str, ...]:
    """The folders of our code: the tba_jax package and the running launcher's folder."""
    roots = [os.path.dirname(os.path.abspath(tba_jax.__file__))]
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        roots.append(os.path.dirname(os.path.abspath(main_file)))
    return tuple(roots)


class LibraryLogFilter(logging.Filter):
    """Passes every record of our own code, and other libraries' only from
    `library_level`, leaving out EXPECTED_LIBRARY_WARNINGS."""

    def __init__(self, own_roots: Sequence[str], library_level: int = logging.WARNING):
        super().__init__()
        self.own_roots = tuple(os.path.join(root, "") for root in own_roots)
        self.library_level = library_level

    def is_own(self, record: logging.LogRecord) -> bool:
        return os.path.abspath(record.pathname).startswith(self.own_roots)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.is_own(record):
            return True
        if record.levelno < self.library_level:
            return False
        message = record.getMessage()
        if message.startswith(PLUGIN_ERROR_PREFIX):
            as_plugin_notice(record)
        return not message.startswith(EXPECTED_LIBRARY_WARNINGS)


def as_plugin_notice(record: logging.LogRecord) -> None:
    """Rewrites JAX's plugin-error record (a traceback through the plugin's version checks)
    as our one-line warning: which plugin, its error, and what to do. JAX goes on without
    it, on the CPU where no other accelerator is there."""
    plugin = re.search(r"jax_plugins\.(\w+)", record.getMessage())
    error = record.exc_info[1] if record.exc_info else None
    record.msg = (
        f"JAX's {plugin.group(1) if plugin else 'accelerator'} plugin did not start"
        f"{f' ({one_line(str(error))})' if error else ''}, so JAX runs without it (on the CPU "
        "if nothing else is there); set JAX_PLATFORMS=cpu to skip it, or fix the GPU's driver "
        "to use it."
    )
    record.args = None
    record.exc_info = record.exc_text = None
    record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
    record.tba_notice = True


class OwnNoticeFormatter(absl_logging.PythonFormatter):
    """absl's format, except our own warnings and errors (without a traceback) and the
    library records we rewrite as ours (`as_plugin_notice`): one `warning: ...` /
    `error: ...` line, as the launchers print a user's mistake."""

    def __init__(self, own: LibraryLogFilter):
        super().__init__()
        self.own = own

    def format(self, record: logging.LogRecord) -> str:
        ours = self.own.is_own(record) or getattr(record, "tba_notice", False)
        if record.levelno >= logging.WARNING and not record.exc_info and ours:
            return f"{record.levelname.lower()}: {record.getMessage()}"
        return super().format(record)


def hide_library_progress_bars() -> None:
    """TFDS draws bars while it prepares a dataset (when the launcher has loaded it)."""
    tfds = sys.modules.get("tensorflow_datasets")
    if tfds is not None:
        tfds.disable_progress_bar()


def configure_console() -> None:
    """Our INFO logs without absl's prefix and our warnings as `warning: ...` lines;
    libraries' logs only from WARNING, in absl's format; no library progress bars. Nothing
    changes when `--verbosity`/`-v` was given. Call after the flags are parsed (`run`
    does)."""
    if flags.FLAGS[VERBOSITY_FLAG].present:
        return
    if not flags.FLAGS[INFO_PREFIX_FLAG].present:
        setattr(flags.FLAGS, INFO_PREFIX_FLAG, False)
    handler = absl_logging.get_absl_handler()
    if not any(isinstance(installed, LibraryLogFilter) for installed in handler.filters):
        own = LibraryLogFilter(own_source_roots())
        handler.addFilter(own)
        handler.setFormatter(OwnNoticeFormatter(own))
    hide_library_progress_bars()


def configure_interactive_console() -> None:
    """`configure_console` in a process whose command line is not absl's (a notebook's
    kernel, a script calling `train.train_and_evaluate`): our progress and notices at INFO
    through absl's handler, without its prefix; libraries' logs from WARNING; no library
    progress bars. The flags keep their defaults (marked parsed, so absl does not warn)."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    absl_logging.use_absl_handler()
    absl_logging.set_verbosity(absl_logging.INFO)
    configure_console()


# absl's --verbosity, explained for our console and shown in every launcher's --help.
flags.FLAGS[VERBOSITY_FLAG].help = VERBOSITY_HELP
flags.declare_key_flag(VERBOSITY_FLAG)


def machine_fields() -> dict[str, Any]:
    """What a benchmark's JSON line records of the machine it ran on: the first device's
    kind, the CPU count, and the JAX and Python versions."""
    import platform

    return {
        "device": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(),
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
    }
