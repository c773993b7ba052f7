"""The paper's experiments as grids of runs, by name (`EXPERIMENTS`).

Each experiment has two scales:

- ``tiny``: the same grid on this CPU in minutes. The GSM8K comparison and the ablations
  run on the built-in arithmetic demo (`configs/arithmetic.py`: a policy that learns in a
  minute, so the effects show); TL;DR and red-teaming run their configs' `tiny` variants
  (random micro reward models, victims and judges: the code path, not the paper's
  effect).
- ``paper``: the paper's configs, given checkpoint folders through `--set` items (e.g.
  `--set=hf_path=/ckpt/rhomath-1b-sft`); `required` names the config keys that must be
  set, and `experiments/reproduce.py` prints the exact commands when one is missing.

Every run is a `Cell`; the runner repeats each for `--seeds` seeds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from tba_jax.reproduce import paper
from tba_jax.reproduce.cells import Cell, with_variant
from tba_jax.reproduce.report import Column

SCALES = ("tiny", "paper")
DEMO = "configs/arithmetic.py"
DEMO_EVAL_EVERY = 50  # learner steps between the demo's in-loop evaluations (its curve)
PAPER_EVAL_EVERY = 100

ACCURACY_COLUMNS = (
    Column("accuracy, start", "eval_accuracy_start", fmt="%"),
    Column("accuracy, end", "eval_accuracy_end", fmt="%"),
    Column("wall s", "wall_seconds", fmt=".0f"),
    Column("samples", "samples_generated", fmt=".0f"),
    Column("lag mean", "mean_policy_lag", fmt=".1f"),
)
TLDR_COLUMNS = (
    Column("win rate (greedy)", "greedy_win_rate", "evaluation", "%"),
    Column("win rate (sampled)", "sampled_win_rate", "evaluation", "%"),
    Column("ref. perplexity", "sampled_ref_perplexity", "evaluation", ".3g"),
    Column("KL", "sampled_kl", "evaluation", ".3g"),
    Column("wall s", "wall_seconds", fmt=".0f"),
    Column("lag mean", "mean_policy_lag", fmt=".1f"),
)
REDTEAM_COLUMNS = (
    Column("% toxic", "toxic_percent", "evaluation", ".1f"),
    Column("diversity", "diversity_all", "evaluation", ".3f"),
    Column("diversity (toxic)", "diversity_toxic", "evaluation", ".3f"),
    Column("wall s", "wall_seconds", fmt=".0f"),
    Column("samples/s", "samples_per_second", fmt=".1f"),
)


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One paper result as a grid.

    Attributes:
      name: what `--experiment` takes.
      title: the page's title, naming the paper's table or figure.
      cells: scale → the grid's cells (seed 0; the runner adds the others).
      columns: the table's figures per run.
      plot_column: the column plotted against `x_name`; None: `curve_metric` against time.
      x_name: the grid's x axis (None: curves against wall-clock).
      x_log: plot x on a logarithmic axis.
      curve_metric: the evaluation scalar plotted against time (in-loop, start and end).
      required: config keys (after the cell's items) that must be non-empty at paper scale.
      notes: scale → what differs from the paper's setting.
    """

    name: str
    title: str
    cells: Callable[[str], list[Cell]]
    columns: Sequence[Column]
    x_name: str | None = None
    plot_column: Column | None = None
    curve_metric: str = "eval_accuracy"
    x_log: bool = False  # a logarithmic x axis
    required: Sequence[str] = ()
    notes: Callable[[str], list[str]] = lambda scale: []

    @property
    def paper(self) -> paper.PaperNumbers:
        return paper.NUMBERS[self.name]


# ---------------------------------------------------------------------------- GSM8K

# (label, items): TBA and the baselines of Fig. 1, each as the runtime runs it.
GSM8K_METHODS = (
    ("TBA (async TB)", ""),
    ("sync TB", "mode=sync"),
    ("RLOO (sync)", "mode=sync,method=rloo"),
    ("GRPO (sync)", "mode=sync,method=grpo"),
    ("online DPO (async)", "method=online_dpo"),
    ("PPO (sync)", "mode=sync,method=ppo"),
    ("VinePPO (sync)", "mode=sync,method=vineppo"),
)


def gsm8k_cells(scale: str) -> list[Cell]:
    if scale == "tiny":
        config, every = DEMO, DEMO_EVAL_EVERY
    else:
        config, every = "configs/gsm8k_rho1b.py", PAPER_EVAL_EVERY
    return [
        Cell(label, with_variant(config, _items(items, f"eval.every_steps={every}")))
        for label, items in GSM8K_METHODS
    ]


def gsm8k_notes(scale: str) -> list[str]:
    if scale == "paper":
        return ["RhoMath-1B SFT checkpoint on GSM8K, one process (the paper used 4 A100s)."]
    return [
        "Tiny scale runs the built-in arithmetic demo (configs/arithmetic.py, a 2-layer "
        "policy warm-started on imperfect demonstrations), not GSM8K: the same methods and "
        "runtime, on a task a CPU learns in a minute.",
        "Wall-clock is this CPU's, sampler and learner sharing its cores.",
    ]


# ---------------------------------------------------------------------------- TL;DR

# Off-policyness: the learner's sync period k (samples up to k updates old); sync = 0.
TLDR_STALENESS = {"tiny": (1, 4), "paper": (1, 2, 4, 8)}
TLDR_ASYNC_METHODS = (("TBA", "tb"), ("online DPO", "online_dpo"), ("PPO", "ppo"))


def tldr_cells(scale: str) -> list[Cell]:
    config = "configs/tldr_pythia.py:tiny" if scale == "tiny" else "configs/tldr_pythia.py"
    cells = [
        Cell("RLOO", with_variant(config, "mode=sync,method=rloo"), x=0, evaluate=True),
    ]
    for label, method in TLDR_ASYNC_METHODS:
        cells.append(
            Cell(label, with_variant(config, f"mode=sync,method={method}"), x=0, evaluate=True)
        )
        for k in TLDR_STALENESS[scale]:
            cells.append(
                Cell(label, with_variant(config, f"method={method},k={k}"), x=k, evaluate=True)
            )
    return cells


def tldr_notes(scale: str) -> list[str]:
    notes = [
        "Off-policyness is the sync period k of an async run (the learner publishes every "
        "k updates, so its samples are up to k updates old); 0 is the sync run. The paper "
        "(after Noukhovitch et al.) counts the updates between generation and training.",
    ]
    if scale == "tiny":
        notes.append(
            "Tiny scale: a random micro policy over characters and random micro reward and "
            "gold models (configs/tldr_pythia.py:tiny), a few learner steps: the numbers "
            "check the pipeline, not the paper's effect."
        )
    return notes


# ---------------------------------------------------------------------------- red-teaming

SEARCHERS = {"tiny": (1, 2), "paper": (1, 2, 4)}


def redteam_cells(scale: str) -> list[Cell]:
    config = "configs/redteam_gpt2.py:tiny" if scale == "tiny" else "configs/redteam_gpt2.py"
    return [
        Cell("TBA", with_variant(config, f"searchers={n}"), x=n, evaluate=True)
        for n in SEARCHERS[scale]
    ]


def redteam_notes(scale: str) -> list[str]:
    if scale == "paper":
        return ["GPT-2 attacker against the GPT-2 Alpaca victim (configs/redteam_gpt2.py)."]
    return [
        "Tiny scale: a random micro attacker, victim and judge (configs/redteam_gpt2.py:tiny):"
        " the numbers check the pipeline, not the paper's effect.",
    ]


# ---------------------------------------------------------------------------- ablations

# Samples per prompt K (S = K) at a fixed batch: prompts per batch = rows / K, as the
# paper's Table 5 keeps its batch size when K doubles.
ABLATION_K = {"tiny": (4, 8, 16), "paper": (10, 20)}  # 140 rows hold no K = 40
ABLATION_K_ROWS = {"tiny": 128, "paper": 140}
ABLATION_M = (0.5, 0.95)  # recency probability
ABLATION_SYNC = (1, 4)  # sync period k
ABLATION_BETA = (0.02, 0.1, 0.5)  # β from the start to the end (no anneal)


def demo_or_paper(scale: str) -> tuple[str, str]:
    """The ablations' config and its in-loop evaluation items."""
    if scale == "tiny":
        return DEMO, f"eval.every_steps={DEMO_EVAL_EVERY}"
    return "configs/gsm8k_rho1b.py", f"eval.every_steps={PAPER_EVAL_EVERY}"


def ablation_k_cells(scale: str) -> list[Cell]:
    config, every = demo_or_paper(scale)
    rows = ABLATION_K_ROWS[scale]
    return [
        Cell(
            "TBA",
            with_variant(config, _items(f"K={k},S={k},batch.prompts_per_batch={rows // k}", every)),
            x=k,
        )
        for k in ABLATION_K[scale]
    ]


def ablation_mk_cells(scale: str) -> list[Cell]:
    config, every = demo_or_paper(scale)
    return [
        Cell(f"m={m:g}", with_variant(config, _items(f"m={m},k={k}", every)), x=k)
        for m in ABLATION_M
        for k in ABLATION_SYNC
    ]


def ablation_beta_cells(scale: str) -> list[Cell]:
    config, every = demo_or_paper(scale)
    return [
        Cell("TBA", with_variant(config, _items(f"beta={b},loss.beta_end={b}", every)), x=b)
        for b in ABLATION_BETA
    ]


def ablation_notes(scale: str) -> list[str]:
    if scale == "paper":
        return ["RhoMath-1B on GSM8K (configs/gsm8k_rho1b.py), one process."]
    return ["Tiny scale runs the built-in arithmetic demo (configs/arithmetic.py)."]


def _items(*parts: str) -> str:
    return ",".join(part for part in parts if part)


FINAL_ACCURACY = ACCURACY_COLUMNS[1]
EXPERIMENTS = {
    experiment.name: experiment
    for experiment in (
        Experiment(
            "gsm8k",
            "GSM8K: accuracy against wall-clock, TBA and the baselines (Fig. 1, Table 2)",
            gsm8k_cells,
            ACCURACY_COLUMNS,
            required=("model.hf_path",),
            notes=gsm8k_notes,
        ),
        Experiment(
            "tldr",
            "TL;DR: win rate and reference perplexity against off-policyness (Table 1)",
            tldr_cells,
            TLDR_COLUMNS,
            x_name="off-policyness (sync period k; 0 = sync)",
            plot_column=TLDR_COLUMNS[0],
            required=(
                "model.hf_path",
                "task.reward_model.hf_path",
                "task.gold_reward_model.hf_path",
            ),
            notes=tldr_notes,
        ),
        Experiment(
            "redteam",
            "Red-teaming: % toxic, diversity and wall time against searchers (Table 6)",
            redteam_cells,
            REDTEAM_COLUMNS,
            x_name="searchers",
            plot_column=REDTEAM_COLUMNS[0],
            required=("model.hf_path", "task.victim.hf_path", "task.judge.hf_path"),
            notes=redteam_notes,
        ),
        Experiment(
            "ablation_k",
            "Ablation: samples per prompt K (Table 5)",
            ablation_k_cells,
            ACCURACY_COLUMNS,
            x_name="K (samples per prompt)",
            x_log=True,
            plot_column=FINAL_ACCURACY,
            required=("model.hf_path",),
            notes=ablation_notes,
        ),
        Experiment(
            "ablation_mk",
            "Ablation: recency probability m and sync period k (Fig. 7)",
            ablation_mk_cells,
            ACCURACY_COLUMNS,
            x_name="sync period k",
            plot_column=FINAL_ACCURACY,
            required=("model.hf_path",),
            notes=ablation_notes,
        ),
        Experiment(
            "ablation_beta",
            "Ablation: KL coefficient β (Fig. 7)",
            ablation_beta_cells,
            ACCURACY_COLUMNS,
            x_name="β",
            x_log=True,
            plot_column=FINAL_ACCURACY,
            required=("model.hf_path",),
            notes=ablation_notes,
        ),
    )
}
