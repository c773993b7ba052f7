r"""The replay buffer at scale: batch draws, adds, state_dict / restore and memory per sample.

    python benchmarks/replay_scale.py                                # 10k, 100k, 1M samples
    python benchmarks/replay_scale.py --sizes=10000,100000,300000 --draw_rules=newest
    python benchmarks/replay_scale.py --smoke                        # seconds: it runs, no more

For each size N and draw rule (`replay.draw_rule`), a fresh process fills a
`ReplayBuffer(capacity=N, capacity_per_prompt=100)` with N samples shaped like a search
call's output: calls of `--prompts_per_call` prompts × `--samples_per_prompt` S responses,
prompts of `--prompt_len` tokens, responses of 1 to `--max_response_len` tokens (uniform),
per-token log-probs, the policy version advancing (and a sync marked, where the buffer
has `mark_sync`) every `--calls_per_version` calls. Prompt ids cycle over N / 32 prompts,
so a prompt holds about 32 samples when the buffer is full. Then, on the full buffer:

- sample_ms: the median wall time of `--draws` draws of B × K (`--batch_prompts` ×
  `--batch_k`) with recency probability `--recency_prob`; p90 beside it;
- add_per_s (fill): samples added per second of time spent inside `add` while filling;
  add_full_per_s: the same for `--full_adds` more samples once full, each add evicting
  as many (the steady state of a long run);
- state_dict_s, load_s: `state_dict()` of the full buffer, and `load_state_dict` of it
  into a fresh buffer;
- bytes_per_sample: the process's resident memory after the fill minus before building
  the buffer, over N (the trajectories an add takes are made and freed call by call),
  against token_bytes_per_sample: a sample's int32 prompt and response tokens and its two
  float32 per-token log-probs, 4·P + 12·T bytes on average.

Every figure is a wall-clock time on whatever else the machine is doing. The last stdout
line is JSON: {"benchmark": "replay_scale", "results": [{"size", "draw_rule", ...}, ...],
then the settings}. The script only uses `ReplayBuffer`'s public methods, so it also runs
against older code (`--draw_rules=newest`, the only rule there).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import flags

from tba_jax import cli, replay
from tba_jax.replay import ReplayBuffer
from tba_jax.trajectories import Trajectory

SMOKE = dict(sizes=[2000], full_adds=1000, draws=20)
SAMPLES_PER_PROMPT_WHEN_FULL = 32
CAPACITY_PER_PROMPT = 100

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_list("sizes", ["10000", "100000", "1000000"], "Buffer sizes N to fill.")
    flags.DEFINE_list("draw_rules", ["newest", "authors"], "replay.draw_rule values.")
    flags.DEFINE_integer("prompt_len", 64, "P: tokens per prompt.", lower_bound=1)
    flags.DEFINE_integer(
        "max_response_len", 128, "T: response lengths are uniform in 1..T.", lower_bound=1
    )
    flags.DEFINE_integer("prompts_per_call", 16, "Prompts per add call.", lower_bound=1)
    flags.DEFINE_integer("samples_per_prompt", 8, "S: samples per prompt.", lower_bound=1)
    flags.DEFINE_integer(
        "calls_per_version", 10, "Add calls per policy version (and sync).", lower_bound=1
    )
    flags.DEFINE_integer("batch_prompts", 16, "B: prompts per draw.", lower_bound=1)
    flags.DEFINE_integer("batch_k", 8, "K: samples per prompt per draw.", lower_bound=1)
    flags.DEFINE_float(
        "recency_prob", 0.5, "m: recency (online) probability.", lower_bound=0.0, upper_bound=1.0
    )
    flags.DEFINE_integer("draws", 200, "Timed draws per size.", lower_bound=1)
    flags.DEFINE_integer(
        "full_adds", 100_000, "Samples added to the full buffer (each evicting one).", lower_bound=0
    )
    flags.DEFINE_boolean("smoke", False, f"Small and quick: {SMOKE}.")
    flags.DEFINE_string("one", "", "Internal: measure one 'size,draw_rule' in this process.")
    flags.adopt_module_key_flags(cli)


@dataclasses.dataclass(frozen=True)
class Settings:
    prompt_len: int
    max_response_len: int
    prompts_per_call: int
    samples_per_prompt: int
    calls_per_version: int
    batch_prompts: int
    batch_k: int
    recency_prob: float
    draws: int
    full_adds: int


def read_settings() -> Settings:
    smoke = FLAGS.smoke
    return Settings(
        prompt_len=FLAGS.prompt_len,
        max_response_len=FLAGS.max_response_len,
        prompts_per_call=FLAGS.prompts_per_call,
        samples_per_prompt=FLAGS.samples_per_prompt,
        calls_per_version=FLAGS.calls_per_version,
        batch_prompts=FLAGS.batch_prompts,
        batch_k=FLAGS.batch_k,
        recency_prob=FLAGS.recency_prob,
        draws=SMOKE["draws"] if smoke else FLAGS.draws,
        full_adds=SMOKE["full_adds"] if smoke else FLAGS.full_adds,
    )


def draw_rules_here() -> tuple[str, ...]:
    """The draw rules this ReplayBuffer takes (older code has no draw_rule: "newest" only)."""
    if "draw_rule" not in inspect.signature(ReplayBuffer).parameters:
        return ("newest",)
    return tuple(getattr(replay, "DRAW_RULES", ("authors", "newest")))


def sizes_and_draw_rules() -> tuple[list[int], list[str]]:
    """The sizes and draw rules to measure; UsageError (in the parent, before any child is
    started) for a size that is no integer or holds less than one prompt's samples, and
    for a draw rule this ReplayBuffer does not have."""
    sizes = FLAGS.sizes
    if FLAGS.smoke:
        sizes = SMOKE["sizes"]
    try:
        sizes = [int(size) for size in sizes]
    except ValueError as error:
        raise cli.UsageError(f"--sizes={','.join(sizes)}: pass integers ({error}).") from error
    small = [size for size in sizes if size < CAPACITY_PER_PROMPT]
    if small or not sizes:
        raise cli.UsageError(
            f"--sizes={','.join(map(str, sizes))}: each buffer size must be at least the "
            f"samples one prompt keeps (capacity_per_prompt={CAPACITY_PER_PROMPT}); pass sizes "
            f">= {CAPACITY_PER_PROMPT}."
        )
    rules = draw_rules_here()
    unknown = sorted(set(FLAGS.draw_rules) - set(rules))
    if unknown or not FLAGS.draw_rules:
        raise cli.UsageError(
            f"--draw_rules={','.join(FLAGS.draw_rules)}: choose from {list(rules)}."
        )
    return sizes, list(FLAGS.draw_rules)


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_buffer(size: int, draw_rule: str, settings: Settings) -> ReplayBuffer:
    kwargs = dict(
        max_prompt_len=settings.prompt_len,
        max_response_len=settings.max_response_len,
        pad_id=0,
        capacity=size,
        capacity_per_prompt=CAPACITY_PER_PROMPT,
        recency_prob=settings.recency_prob,
        priority="softmax",
        priority_inverse_temperature=1.0,
    )
    if "draw_rule" in inspect.signature(ReplayBuffer).parameters:
        kwargs["draw_rule"] = draw_rule
    elif draw_rule != "newest":
        raise SystemExit(f"this ReplayBuffer has no draw_rule; it only draws {draw_rule!r}")
    return ReplayBuffer(**kwargs)


class CallMaker:
    """Search calls' worth of trajectories: prompts cycle over `num_prompts` ids."""

    def __init__(self, num_prompts: int, settings: Settings, seed: int = 0):
        self.settings, self.num_prompts = settings, num_prompts
        self.rng = np.random.default_rng(seed)
        self.calls = 0
        self.next_prompt = 0

    def prompt_tokens(self, prompt_id: int) -> np.ndarray:
        return (np.arange(self.settings.prompt_len, dtype=np.int32) + prompt_id) % 50_000

    @property
    def version(self) -> int:
        return self.calls // self.settings.calls_per_version

    def next_call(self) -> list[Trajectory]:
        s = self.settings
        rows = s.prompts_per_call * s.samples_per_prompt
        lengths = self.rng.integers(1, s.max_response_len + 1, size=rows)
        tokens = self.rng.integers(3, 50_000, size=int(lengths.sum()), dtype=np.int32)
        logps = -self.rng.random(int(lengths.sum()), dtype=np.float32)
        rewards = self.rng.normal(size=rows)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        trajectories = []
        for row in range(rows):
            prompt_id = (self.next_prompt + row // s.samples_per_prompt) % self.num_prompts
            piece = slice(starts[row], starts[row + 1])
            trajectories.append(
                Trajectory(
                    prompt_id=prompt_id,
                    prompt_tokens=self.prompt_tokens(prompt_id),
                    response_tokens=tokens[piece],
                    reward=float(rewards[row]),
                    logp_behaviour=float(logps[piece].sum()),
                    logp_ref=float(logps[piece].sum()) - 1.0,
                    token_logp_behaviour=logps[piece],
                    token_logp_ref=logps[piece] - 0.01,
                    policy_version=self.version,
                    created_at=float(self.calls),
                )
            )
        self.next_prompt = (self.next_prompt + s.prompts_per_call) % self.num_prompts
        self.calls += 1
        return trajectories


def timed_adds(buffer: ReplayBuffer, maker: CallMaker, num_samples: int) -> tuple[float, int]:
    """Adds about `num_samples` samples call by call; (seconds inside add, samples added)."""
    seconds, added = 0.0, 0
    while added < num_samples:
        version_before = maker.version
        call = maker.next_call()
        if maker.version != version_before and hasattr(buffer, "mark_sync"):
            buffer.mark_sync(maker.version)
        start = time.perf_counter()
        buffer.add(call)
        seconds += time.perf_counter() - start
        added += len(call)
    return seconds, added


def token_bytes_per_sample(settings: Settings) -> float:
    mean_response = (settings.max_response_len + 1) / 2
    return 4 * settings.prompt_len + 12 * mean_response


def measure_one(size: int, draw_rule: str, settings: Settings) -> dict:
    num_prompts = max(1, size // SAMPLES_PER_PROMPT_WHEN_FULL)
    maker = CallMaker(num_prompts, settings)
    rss_before = resident_bytes()
    buffer = make_buffer(size, draw_rule, settings)
    fill_s, filled = timed_adds(buffer, maker, size)
    rss_after = resident_bytes()
    stored = len(buffer)

    rng = np.random.default_rng(1)
    draw_ms = []
    for _ in range(settings.draws):
        start = time.perf_counter()
        buffer.sample(settings.batch_prompts, settings.batch_k, rng)
        draw_ms.append(1e3 * (time.perf_counter() - start))

    start = time.perf_counter()
    state = buffer.state_dict()
    state_dict_s = time.perf_counter() - start
    restored = make_buffer(size, draw_rule, settings)
    start = time.perf_counter()
    restored.load_state_dict(state)
    load_s = time.perf_counter() - start
    del restored, state

    full_s, full_added = timed_adds(buffer, maker, settings.full_adds)
    draw_ms.sort()
    return {
        "size": size,
        "draw_rule": draw_rule,
        "stored": stored,
        "prompts": num_prompts,
        "sample_ms": statistics.median(draw_ms),
        "sample_ms_p90": draw_ms[int(0.9 * (len(draw_ms) - 1))],
        "add_per_s": filled / fill_s,
        "add_full_per_s": full_added / full_s if full_added else None,
        "state_dict_s": state_dict_s,
        "load_s": load_s,
        "bytes_per_sample": (rss_after - rss_before) / stored,
        "token_bytes_per_sample": token_bytes_per_sample(settings),
    }


def measure_in_subprocess(size: int, draw_rule: str) -> dict:
    """`measure_one` in a fresh process, so each size's memory figure starts clean."""
    argv = [arg for arg in sys.argv[1:] if not arg.startswith("--one")]
    command = [sys.executable, __file__, *argv, f"--one={size},{draw_rule}"]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def describe(r: dict) -> str:
    full = f"{r['add_full_per_s']:,.0f}/s" if r["add_full_per_s"] else "-"
    return (
        f"{r['size']:>9,} {r['draw_rule']:>7}: sample {r['sample_ms']:.3f} ms "
        f"(p90 {r['sample_ms_p90']:.3f}), add {r['add_per_s']:,.0f}/s (full: {full}), "
        f"state_dict {r['state_dict_s']:.2f} s, load {r['load_s']:.2f} s, "
        f"{r['bytes_per_sample']:,.0f} B/sample ({r['token_bytes_per_sample']:,.0f} token B)"
    )


def rounded(value):
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def main(argv: list[str]) -> None:
    del argv
    settings = read_settings()
    if FLAGS.one:
        size, draw_rule = FLAGS.one.split(",")
        print(json.dumps(measure_one(int(size), draw_rule, settings)), flush=True)
        return
    sizes, draw_rules = sizes_and_draw_rules()
    results = []
    for size in sizes:
        for draw_rule in draw_rules:
            results.append(measure_in_subprocess(size, draw_rule))
            print(describe(results[-1]), flush=True)
    line = {
        "benchmark": "replay_scale",
        "results": [rounded(r) for r in results],
        **dataclasses.asdict(settings),
        "cpus": os.cpu_count(),
        "python_version": platform.python_version(),
        "numpy_version": np.__version__,
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
