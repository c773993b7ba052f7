r"""Reproduces one of the paper's results: runs its grid, then writes a table and a plot.

    # on this CPU, in minutes: the same grid on the demo task and the tiny variants
    python experiments/reproduce.py --experiment=gsm8k --scale=tiny --out=/tmp/repro
    python experiments/reproduce.py --experiment=ablation_k --seeds=3 --out=/tmp/repro
    # the paper's configs, given the checkpoints (without them: the exact commands,
    # one per line, in <out>/commands.sh)
    python experiments/reproduce.py --experiment=gsm8k --scale=paper --out=/ckpt/repro \
        --set=hf_path=/ckpt/rho-1b-sft-GSM8K

Experiments: gsm8k (Fig. 1 / Table 2: accuracy against wall-clock, TBA and the
baselines), tldr (Table 1: win rate and reference perplexity against off-policyness),
redteam (Table 6: % toxic, diversity and wall time against searchers), ablation_k
(Table 5), ablation_mk and ablation_beta (Fig. 7). Each run trains with the README's
command in `<out>/runs/<experiment>/<run>/`; a rerun skips finished runs (so more
`--seeds` adds runs). Writes `<out>/<experiment>.md` (our numbers, mean ± std over seeds,
beside the paper's, with its setting), `<out>/<experiment>.csv` (one row per run) and
`<out>/<experiment>.png`. See `tba_jax/reproduce/grids.py` for every grid.
"""

from absl import flags

from tba_jax import cli
from tba_jax.config_lib import ConfigError
from tba_jax.reproduce.cells import RunError
from tba_jax.reproduce.grids import EXPERIMENTS, SCALES
from tba_jax.reproduce.runner import MissingSettings, reproduce


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_enum("experiment", None, sorted(EXPERIMENTS), "The paper result to reproduce.")
    flags.DEFINE_enum("scale", "tiny", SCALES, "tiny: this CPU, minutes; paper: the paper's.")
    flags.DEFINE_string("out", None, "Where the runs, tables and plots go.")
    flags.DEFINE_integer("seeds", 1, "Runs per grid cell (seeds 0 .. N-1): error bars.")
    flags.DEFINE_list(
        "set", [], "key=value items added to every run's config, e.g. hf_path=/ckpt/policy."
    )
    flags.mark_flags_as_required(["experiment", "out"])


def main(argv):
    del argv
    values = flags.FLAGS
    cli.check_output_dir(values.out, "out")
    written = reproduce(
        values.experiment,
        values.scale,
        values.out,
        seeds=values.seeds,
        items=",".join(values.set),
    )
    print("Wrote " + ", ".join(written))


if __name__ == "__main__":
    define_flags()
    cli.run(main, user_errors=(ConfigError, RunError, MissingSettings, ValueError))
