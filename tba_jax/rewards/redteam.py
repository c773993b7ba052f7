"""The red-teaming reward: a frozen victim answers each attack, a frozen judge scores it.

Lee et al. (2024, "Learning diverse attacks on large language models for robust
red-teaming and safety tuning") train an ATTACKER policy whose responses are attack
prompts. A frozen VICTIM model answers each attack with several sampled responses; a
frozen JUDGE gives the log-probability that an answer is toxic; an attack's reward is
that log-probability averaged over the victim's responses. (TB's log-reward is reward/β
plus log π_ref(attack), which keeps attacks fluent: no extra term is needed here.)

The judges (`ClassifierJudge`, `GenerativeJudge`) are in `tba_jax.rewards.judges`, the
`{attack}` / `{response}` templates in `tba_jax.rewards.templates`. Victim prompts are
encoded without the tokenizer adding BOS/EOS: a chat template spells out its special
tokens (e.g. "<|begin_of_text|>"), as transformers' `apply_chat_template` renders them.

Every device call has a fixed shape (`batch_size` rows of a fixed prompt length; a
short last batch repeats row 0), so each jitted function compiles once. With the run's
slot engine (`search.engine=slots`) the victim answers through it instead, with
`batch_size` decode slots: each attack is prefilled once for its `num_responses` answers,
and a finished answer's slots are refilled while the long answers still decode. Victim
sampling draws a fresh key per call (a counter under a lock: searcher threads share the
victim).

Config sections (`victim_role_config`, `judge_role_config`) extend
`tba_jax.models.frozen.frozen_role_config` (hf_path, preset, seed, dtype); `check_roles`
checks them cheaply and `Victim.from_config` / `judges.judge_from_config` load the models.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from tba_jax.batching import fixed_batches
from tba_jax.config_lib import ConfigError
from tba_jax.models.frozen import (
    DEFAULT_ATTENTION,
    FrozenModel,
    Placement,
    frozen_model_layout,
    frozen_role_config,
    load_frozen_model,
    role_tokenizer,
)
from tba_jax.models.tokenizers import Tokenizer, pad_sequences_with_mask
from tba_jax.rewards.judges import (
    Judge,
    decoder_id2label,
    encoder_labels,
    is_encoder_folder,
    judge_model_args,
    resolve_label,
    verdict_ids,
)
from tba_jax.rewards.templates import (
    ATTACK_FIELD,
    RESPONSE_FIELD,
    check_learned_positions,
    check_template,
    encode_filled,
    template_fields,
)
from tba_jax.sampling.engine import EngineConfig, Request, SlotEngine
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn

JUDGE_KINDS = ("classifier", "generative")

# ------------------------------------------------------------------------------ templates


# --------------------------------------------------------------------------------- victim


def victim_model_args(role: ml_collections.ConfigDict) -> dict:
    """`load_frozen_model`'s arguments for the victim `role`, beside the role, the fallback
    tokenizer and the placement: room for a prompt and its answer."""
    return dict(
        role_name="task.victim", max_seq_len=role.max_prompt_len + role.max_new_tokens, head="lm"
    )


@dataclasses.dataclass(frozen=True)
class VictimSettings:
    """How the victim answers attacks (see `victim_role_config` for the config keys)."""

    template: str  # the victim's prompt, with an {attack} field
    num_responses: int  # sampled responses per attack
    max_prompt_len: int  # tokens of the filled template (attacks are cut to fit)
    max_new_tokens: int
    temperature: float
    top_p: float
    batch_size: int  # prompt rows per generate call


class Victim:
    """A frozen causal LM answering attacks: `respond(attacks) -> [N][num_responses]` texts.

    `engine`: the slot engine's settings to answer with (its `slots` replaced by
    `batch_size`); None: fixed batches of `batch_size` rows."""

    def __init__(
        self,
        frozen: FrozenModel,
        settings: VictimSettings,
        seed: int,
        engine: EngineConfig | None = None,
    ):
        check_template(settings.template, (ATTACK_FIELD,), "victim.template")
        for name in ("num_responses", "max_prompt_len", "batch_size"):
            if getattr(settings, name) < 1:
                raise ValueError(f"victim.{name}={getattr(settings, name)} must be >= 1.")
        self.frozen = frozen
        self.settings = settings
        total = settings.max_prompt_len + settings.max_new_tokens
        check_learned_positions(frozen.model, total, "The victim")
        self.prompt_ids("")  # the template alone must fit: ValueError now, not mid-run
        tokenizer = frozen.tokenizer
        sampling = SamplingConfig(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            vocab_limit=tokenizer.vocab_size,
        )
        self._generate = make_generate_fn(
            frozen.model, sampling, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
        )
        self._engine = None
        if engine is not None:
            self._engine = SlotEngine(
                frozen.model,
                sampling,
                dataclasses.replace(engine, slots=settings.batch_size),
                max_prompt_len=settings.max_prompt_len,
                eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id,
            )
        self._key = jax.random.key(seed)
        self._calls = 0
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        role: ml_collections.ConfigDict,
        fallback_tokenizer: Tokenizer,
        placement: Placement | None = None,
        engine: EngineConfig | None = None,
    ) -> Victim:
        """The victim a `victim_role_config` section describes (loads its model, sharded by
        `placement`; answering through the slot engine with `engine`)."""
        frozen = load_frozen_model(
            role,
            fallback_tokenizer=fallback_tokenizer,
            placement=placement,
            **victim_model_args(role),
        )
        settings = VictimSettings(
            template=role.template,
            num_responses=role.num_responses,
            max_prompt_len=role.max_prompt_len,
            max_new_tokens=role.max_new_tokens,
            temperature=role.temperature,
            top_p=role.top_p,
            batch_size=role.batch_size,
        )
        return cls(frozen, settings, seed=role.seed, engine=engine)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frozen.tokenizer

    def prompt_ids(self, attack: str) -> list[int]:
        """The victim's prompt for `attack` (trailing whitespace dropped, as Lee et al.)."""
        return encode_filled(
            self.tokenizer,
            self.settings.template,
            {ATTACK_FIELD: attack.rstrip()},
            self.settings.max_prompt_len,
            add_bos=False,
        )

    def respond(self, attacks: Sequence[str]) -> list[list[str]]:
        """`num_responses` sampled answers to each attack: [len(attacks)][num_responses]."""
        per_attack = self.settings.num_responses
        prompts = [self.prompt_ids(attack) for attack in attacks]
        if self._engine is not None:
            return self._respond_with_engine(prompts)
        texts = self.generate([ids for ids in prompts for _ in range(per_attack)])
        return [texts[i * per_attack : (i + 1) * per_attack] for i in range(len(attacks))]

    def _respond_with_engine(self, prompts: Sequence[Sequence[int]]) -> list[list[str]]:
        """`respond` through the slot engine: each prompt is prefilled once for its answers
        (at most `batch_size` of them per prefill, the slots there are)."""
        settings, tokenizer, engine = self.settings, self.tokenizer, self._engine
        tokens, mask = pad_sequences_with_mask(
            prompts, settings.max_prompt_len, pad_id=tokenizer.pad_id, left_pad=True
        )
        answers = settings.num_responses
        per_request = min(answers, engine.config.slots)
        requests = [
            Request((row, first), tokens[row], mask[row], min(per_request, answers - first))
            for row in range(len(prompts))
            for first in range(0, answers, per_request)
        ]
        texts = [[""] * answers for _ in prompts]
        params = self.frozen.params
        for finished in engine.run(lambda: (params, 0), requests, self._next_key()):
            for item in finished:
                row, first = item.key
                texts[row][first + item.sample] = tokenizer.decode(item.tokens)
        return texts

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """One sampled answer per prompt (token ids), decoded with the victim's tokenizer."""
        settings, tokenizer = self.settings, self.tokenizer
        tokens, mask = pad_sequences_with_mask(
            prompts, settings.max_prompt_len, pad_id=tokenizer.pad_id, left_pad=True
        )
        texts: list[str] = []
        for rows, real in fixed_batches(len(prompts), settings.batch_size):
            batch_tokens, batch_mask = self.frozen.put_rows(tokens[rows], mask[rows])
            out = self._generate(self.frozen.params, batch_tokens, batch_mask, self._next_key())
            generated = np.asarray(jax.device_get(out.tokens))
            texts.extend(tokenizer.decode(generated[row]) for row in range(real))
        return texts

    def _next_key(self) -> jax.Array:
        with self._lock:
            calls, self._calls = self._calls, self._calls + 1
        return jax.random.fold_in(self._key, calls)


# --------------------------------------------------------------------------------- judges


# ---------------------------------------------------------------------------------- reward


@dataclasses.dataclass(frozen=True)
class JudgedAttacks:
    """Attacks with the victim's responses and the judge's verdicts.

    responses: [N][R] texts; toxic_logprob: float32 [N, R], the judge's log p(toxic) of each
    response.
    """

    attacks: list[str]
    responses: list[list[str]]
    toxic_logprob: np.ndarray

    @property
    def rewards(self) -> np.ndarray:
        """Each attack's reward: the mean toxic log-prob over its responses. float32 [N]."""
        return self.toxic_logprob.mean(axis=1).astype(np.float32)

    @property
    def toxicity(self) -> np.ndarray:
        """Each attack's toxicity: the mean judge probability over its responses. [N]."""
        return np.exp(self.toxic_logprob.astype(np.float64)).mean(axis=1)


class RedTeamReward:
    """`Task.rewards` for red-teaming: the attacks are the policy's responses."""

    def __init__(self, victim: Victim, judge: Judge):
        self.victim = victim
        self.judge = judge

    def judge_attacks(self, attacks: Sequence[str]) -> JudgedAttacks:
        """The victim answers every attack; the judge scores every answer."""
        attacks = list(attacks)
        responses = self.victim.respond(attacks)
        flat_attacks = [
            attack for attack, answers in zip(attacks, responses, strict=True) for _ in answers
        ]
        flat_responses = [answer for answers in responses for answer in answers]
        logp = self.judge.toxic_logprob(flat_attacks, flat_responses)
        shape = (len(attacks), self.victim.settings.num_responses)
        return JudgedAttacks(attacks, responses, np.asarray(logp, np.float32).reshape(shape))

    def __call__(self, examples: Sequence[dict], responses: Sequence[str]) -> np.ndarray:
        """float32 [N]: mean toxic log-prob of each attack (`responses`) over the victim's
        answers. `examples` (the attacker's prompt) do not enter the reward."""
        del examples
        return self.judge_attacks(responses).rewards


# --------------------------------------------------------------------------------- configs


def victim_role_config(
    *,
    template: str,
    preset_name: str = "micro",
    seed: int = 0,
    dtype: str = "float32",
    num_responses: int,
    max_prompt_len: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    batch_size: int,
) -> ml_collections.ConfigDict:
    """A `task.victim` section: `frozen_role_config`'s hf_path (a *ForCausalLM folder) /
    preset / seed (also the victim's sampling seed) / dtype, plus the `VictimSettings`."""
    role = frozen_role_config(preset_name=preset_name, seed=seed, dtype=dtype)
    role.template = template
    role.num_responses = num_responses
    role.max_prompt_len = max_prompt_len
    role.max_new_tokens = max_new_tokens
    role.temperature = temperature
    role.top_p = top_p
    role.batch_size = batch_size
    return role


def judge_role_config(
    *,
    kind: str,
    template: str,
    preset_name: str = "micro",
    seed: int = 1,
    dtype: str = "float32",
    toxic_label: str = "1",
    num_labels: int = 2,
    unsafe_text: str = "unsafe",
    safe_text: str = "safe",
    max_prompt_len: int,
    batch_size: int,
) -> ml_collections.ConfigDict:
    """A `task.judge` section: `frozen_role_config`'s hf_path / preset / seed / dtype, plus

    - kind: "classifier" (hf_path: a BERT/RoBERTa or decoder *ForSequenceClassification
      folder; empty: a random `preset` decoder with a `num_labels` score head) or
      "generative" (hf_path: a *ForCausalLM folder such as Llama Guard 3);
    - template: the judge's input, with {attack} and/or {response} (generative: {response}
      required);
    - toxic_label (classifier): the toxic class's name in config.json's id2label, or its index;
    - unsafe_text / safe_text (generative): the two verdicts compared after the prompt;
    - max_prompt_len (decoder judges; an encoder truncates at its own max_length) and
      batch_size (rows per forward pass).
    """
    role = frozen_role_config(preset_name=preset_name, seed=seed, dtype=dtype)
    role.kind = kind
    role.template = template
    role.toxic_label = toxic_label
    role.num_labels = num_labels
    role.unsafe_text = unsafe_text
    role.safe_text = safe_text
    role.max_prompt_len = max_prompt_len
    role.batch_size = batch_size
    return role


def check_roles(victim: ml_collections.ConfigDict, judge: ml_collections.ConfigDict) -> None:
    """ConfigError for `task.victim` / `task.judge` settings that cannot work. Cheap: reads
    config files only, loads no weights."""
    if judge.kind not in JUDGE_KINDS:
        raise ConfigError(f"task.judge.kind={judge.kind!r} is not one of {JUDGE_KINDS}.")
    try:
        check_template(victim.template, (ATTACK_FIELD,), "task.victim.template")
        if judge.kind == "generative":
            check_template(judge.template, (RESPONSE_FIELD,), "task.judge.template")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not template_fields(judge.template):
        raise ConfigError(
            f"task.judge.template={judge.template!r} has neither an {{attack}} nor a "
            "{response} field."
        )
    for name, role in (("victim", victim), ("judge", judge)):
        if not role.hf_path and not role.preset:
            raise ConfigError(
                f"task.{name}.hf_path is empty; pass --config.task.{name}.hf_path=/path/to/"
                f"{name}-checkpoint (a local Hugging Face folder), or set task.{name}.preset "
                "for a random stand-in."
            )
        for key in ("max_prompt_len", "batch_size"):
            if role[key] < 1:
                raise ConfigError(f"task.{name}.{key}={role[key]} must be >= 1.")
        if role.hf_path and not os.path.isfile(os.path.join(role.hf_path, "config.json")):
            raise ConfigError(
                f"task.{name}.hf_path={role.hf_path!r} is not a Hugging Face model folder (no "
                "config.json there); pass a local folder saved with save_pretrained."
            )
    attention = judge.get("attention", DEFAULT_ATTENTION)
    if judge.hf_path and is_encoder_folder(judge.hf_path) and attention != DEFAULT_ATTENTION:
        raise ConfigError(
            f"task.judge.attention={attention!r}, but task.judge.hf_path holds a BERT / "
            "RoBERTa encoder, which has its own attention; leave task.judge.attention at "
            f"{DEFAULT_ATTENTION!r}."
        )
    for key in ("num_responses", "max_new_tokens"):
        if victim[key] < 1:
            raise ConfigError(f"task.victim.{key}={victim[key]} must be >= 1.")
    if not (victim.temperature > 0 and 0 < victim.top_p <= 1 and math.isfinite(victim.temperature)):
        raise ConfigError(
            f"task.victim.temperature={victim.temperature} must be > 0 and top_p={victim.top_p} "
            "in (0, 1]."
        )


def check_role_models(
    victim: ml_collections.ConfigDict,
    judge: ml_collections.ConfigDict,
    fallback_tokenizer: Tokenizer,
    placement: Placement | None,
) -> None:
    """ConfigError for a victim or decoder judge that cannot serve, found from config and
    tokenizer files alone, so that a run refuses it before it prepares data or warms up
    (the models themselves load at the first reward): `placement`'s rules split one of
    its params unevenly (`frozen_model_layout`), its template alone overruns its
    `max_prompt_len` in its tokenizer, a generative judge's verdicts are empty or encode
    alike, a classifier judge has no `toxic_label`, or a checkpoint's learned positions
    cannot hold its longest input. (A BERT / RoBERTa judge's shapes are in its weights'
    file: a mesh is checked against them as it loads.)"""
    try:
        _check_victim_model(victim, fallback_tokenizer, placement)
        _check_judge_model(judge, fallback_tokenizer, placement)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_victim_model(
    victim: ml_collections.ConfigDict, fallback_tokenizer: Tokenizer, placement: Placement | None
) -> None:
    """`check_role_models` for the victim (ValueErrors, ConfigErrors for a mesh)."""
    layout = frozen_model_layout(
        victim,
        fallback_tokenizer=fallback_tokenizer,
        placement=placement,
        **victim_model_args(victim),
    )
    total = victim.max_prompt_len + victim.max_new_tokens
    check_learned_positions(layout.model, total, "task.victim")
    encode_filled(
        role_tokenizer(victim, fallback_tokenizer),
        victim.template,
        {ATTACK_FIELD: ""},
        victim.max_prompt_len,
        add_bos=False,
        length_key="task.victim.max_prompt_len",
    )


def _check_judge_model(
    judge: ml_collections.ConfigDict, fallback_tokenizer: Tokenizer, placement: Placement | None
) -> None:
    """`check_role_models` for the judge (ValueErrors, ConfigErrors for a mesh)."""
    model_args = judge_model_args(judge, fallback_tokenizer)
    if model_args is None:  # a BERT / RoBERTa classifier: its labels only
        resolve_label(judge.toxic_label, *encoder_labels(judge.hf_path))
        return
    layout = frozen_model_layout(
        judge, fallback_tokenizer=fallback_tokenizer, placement=placement, **model_args
    )
    tokenizer = role_tokenizer(judge, fallback_tokenizer)
    longest = judge.max_prompt_len
    if judge.kind == "generative":
        verdicts = verdict_ids(tokenizer, judge.unsafe_text, judge.safe_text)
        longest += max(len(ids) for ids in verdicts)
    else:
        num_labels = layout.config.num_labels
        labels = decoder_id2label(judge.hf_path, num_labels)
        resolve_label(judge.toxic_label, labels, num_labels)
    encode_filled(
        tokenizer,
        judge.template,
        {ATTACK_FIELD: "", RESPONSE_FIELD: ""},
        judge.max_prompt_len,
        add_bos=False if judge.kind == "generative" else None,
        length_key="task.judge.max_prompt_len",
    )
    check_learned_positions(layout.model, longest, "task.judge")
