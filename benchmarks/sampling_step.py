r"""One sampling step (`generate.sample_token`) at a real vocabulary: what drawing a token
costs beside the decode step that made the logits.

    python benchmarks/sampling_step.py                     # 64 rows × 128,256 ids (Llama 3)
    python benchmarks/sampling_step.py --rows=256 --vocab=151936

For each rule (`--rules`: greedy; temperature; temperature with top-k; with top-p) it
jits `sample_token` on random float32 logits [rows, vocab], runs it once to compile and
`--repeats` times timed, and prints one JSON line {"benchmark": "sampling_step", "rule",
"median_ms", "rows", "vocab", the device}. top-k and top-p find their thresholds without
sorting the vocabulary (`generate.truncate_logits`).
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags

from tba_jax import cli
from tba_jax.sampling.generate import SamplingConfig, sample_token

TEMPERATURE = 0.7
LOGIT_SCALE = 3.0  # random logits' spread: a peaked softmax, as a trained model's
RULES = {
    "greedy": SamplingConfig(max_new_tokens=1, greedy=True),
    "temperature": SamplingConfig(max_new_tokens=1, temperature=TEMPERATURE),
    "top_k": SamplingConfig(max_new_tokens=1, temperature=TEMPERATURE, top_k=50),
    "top_p": SamplingConfig(max_new_tokens=1, temperature=TEMPERATURE, top_p=0.92),
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_integer("rows", 64, "Rows sampled at once.", lower_bound=1)
    flags.DEFINE_integer("vocab", 128_256, "Vocabulary size.", lower_bound=2)
    flags.DEFINE_list("rules", list(RULES), f"Sampling rules, of {list(RULES)}.")
    flags.DEFINE_integer("repeats", 5, "Timed steps per rule.", lower_bound=1)
    flags.adopt_module_key_flags(cli)


def median_ms(sampling: SamplingConfig, logits: jax.Array, repeats: int) -> float:
    step = jax.jit(lambda logits, rng: sample_token(logits, rng, sampling))
    jax.block_until_ready(step(logits, jax.random.key(0)))
    seconds = []
    for index in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(step(logits, jax.random.key(index + 1)))
        seconds.append(time.perf_counter() - started)
    return 1e3 * statistics.median(seconds)


def main(argv: list[str]) -> None:
    del argv
    unknown = sorted(set(FLAGS.rules) - set(RULES))
    if unknown:
        raise cli.UsageError(f"--rules names {unknown}; choose from {list(RULES)}.")
    shape = (FLAGS.rows, FLAGS.vocab)
    logits = LOGIT_SCALE * jax.random.normal(jax.random.key(0), shape, jnp.float32)
    machine = cli.machine_fields()
    for rule in FLAGS.rules:
        line = {
            "benchmark": "sampling_step",
            "rule": rule,
            "median_ms": round(median_ms(RULES[rule], logits, FLAGS.repeats), 2),
            "rows": shape[0],
            "vocab": shape[1],
            **machine,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
