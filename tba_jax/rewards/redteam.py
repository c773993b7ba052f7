"""The red-teaming reward: a frozen victim answers each attack, a frozen judge scores it.

Lee et al. (2024, "Learning diverse attacks on large language models for robust
red-teaming and safety tuning") train an ATTACKER policy whose responses are attack
prompts. A frozen VICTIM model answers each attack with several sampled responses; a
frozen JUDGE gives the log-probability that an answer is toxic; an attack's reward is
that log-probability averaged over the victim's responses. (TB's log-reward is reward/β
plus log π_ref(attack), which keeps attacks fluent: no extra term is needed here.)

Judges share one interface, `toxic_logprob(attacks, responses) -> float32 [N]`:

- `ClassifierJudge`: a sequence classifier reads its `template` filled with the attack
  and the response (Lee et al.'s GPT-2 setup: facebook/roberta-hate-speech-dynabench-r4-
  target on the response alone); the toxic log-prob is log_softmax(logits) at the toxic
  label. The classifier is a BERT / RoBERTa encoder (`EncoderClassifier`, through
  `tba_jax.models.encoder.TextEncoder`) or a decoder with a score head
  (`ScoreHeadClassifier`: a *ForSequenceClassification checkpoint or a random stand-in).
- `GenerativeJudge`: a causal LM prompted with its `template` (Llama Guard 3's for the
  Llama setup). With log p_u and log p_s the teacher-forced log-probs of `unsafe_text` and
  `safe_text` right after the prompt, the toxic log-prob is
  log p_u − logsumexp(log p_u, log p_s) (Lee et al.'s soft label over "unsafe" vs "safe").

Templates: `{attack}` and `{response}` are their fields, filled in one pass (a field's
own text is never substituted into); nothing else is special, so braces may appear.
Victim and generative-judge prompts are encoded without the tokenizer adding BOS/EOS: a
chat template spells out its special tokens (e.g. "<|begin_of_text|>"), as transformers'
`apply_chat_template` renders them. Classifier inputs get the tokenizer's default special
tokens, as transformers' classification pipelines add them. A prompt longer than its
budget loses tokens from the end of its longest field until it fits.

Every device call has a fixed shape (`batch_size` rows of a fixed prompt length; a
short last batch repeats row 0), so each jitted function compiles once. Victim sampling
draws a fresh key per call (a counter under a lock: searcher threads share the victim).

Config sections (`victim_role_config`, `judge_role_config`) extend
`tba_jax.models.frozen.frozen_role_config` (hf_path, preset, seed, dtype); `check_roles`
checks them cheaply and `Victim.from_config` / `judge_from_config` load the models.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tba_jax.batching import fixed_batches
from tba_jax.config_lib import ConfigError
from tba_jax.models import FAMILIES, Model, Params, positions_from_mask, sequence_scores
from tba_jax.models.frozen import FrozenModel, frozen_role_config, load_frozen_model
from tba_jax.models.tokenizers import Tokenizer, pad_sequences_with_mask
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn

ATTACK_FIELD = "attack"
RESPONSE_FIELD = "response"
_FIELD_PATTERN = re.compile(r"\{(attack|response)\}")
JUDGE_KINDS = ("classifier", "generative")

# ------------------------------------------------------------------------------ templates


def fill_template(template: str, fields: Mapping[str, str]) -> str:
    """`template` with each `{attack}` / `{response}` replaced by `fields[name]` (a field
    not in `fields` stays as written)."""
    return _FIELD_PATTERN.sub(lambda match: fields.get(match.group(1), match.group(0)), template)


def template_fields(template: str) -> set[str]:
    """The field names `template` uses (a subset of {"attack", "response"})."""
    return set(_FIELD_PATTERN.findall(template))


def check_template(template: str, required: Sequence[str], where: str) -> None:
    """ValueError naming `where` (e.g. "task.victim.template") when a field is missing."""
    missing = [name for name in required if name not in template_fields(template)]
    if missing:
        raise ValueError(
            f"{where}={template[:60]!r}... has no {{{missing[0]}}} field; write "
            f"{{{missing[0]}}} where the {missing[0]} text goes."
        )


def encode_filled(
    tokenizer: Tokenizer,
    template: str,
    fields: Mapping[str, str],
    max_len: int,
    *,
    add_bos: bool | None,
) -> list[int]:
    """Ids of the filled `template`, at most `max_len` of them.

    While the encoding is too long, the field with the most tokens loses as many tokens
    from its end as the encoding is over (re-encoding the joined text can merge tokens
    differently, hence the loop; each round shortens a field, so it ends). `add_bos`: as
    `Tokenizer.encode` (None: the tokenizer's default); EOS is never added. ValueError
    when the template with empty fields is already longer than `max_len`.
    """
    used = template_fields(template)
    field_ids = {
        name: tokenizer.encode(text, add_bos=False, add_eos=False)
        for name, text in fields.items()
        if name in used
    }
    budgets = {name: len(ids) for name, ids in field_ids.items()}
    texts = {name: fields[name] for name in field_ids}
    while True:
        ids = tokenizer.encode(fill_template(template, texts), add_bos=add_bos, add_eos=False)
        overflow = len(ids) - max_len
        if overflow <= 0:
            return ids
        longest = max(budgets, key=budgets.get, default=None)
        if longest is None or budgets[longest] == 0:
            raise ValueError(
                f"The template {template[:60]!r}... alone is {len(ids)} tokens, more than its "
                f"max_len={max_len}; raise the max_prompt_len of this role."
            )
        budgets[longest] = max(budgets[longest] - overflow, 0)
        texts[longest] = tokenizer.decode(field_ids[longest][: budgets[longest]])


def check_learned_positions(model: Model, length: int, where: str) -> None:
    """ValueError when `length` tokens overrun a learned position table (GPT-2: 1024)."""
    config = model.config
    if config.position_embedding == "learned" and length > config.max_seq_len:
        raise ValueError(
            f"{where} needs {length} positions but the model has {config.max_seq_len} learned "
            "ones; lower its max_prompt_len or max_new_tokens."
        )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis, in float64."""
    x = np.asarray(logits, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# --------------------------------------------------------------------------------- victim


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
    """A frozen causal LM answering attacks: `respond(attacks) -> [N][num_responses]` texts."""

    def __init__(self, frozen: FrozenModel, settings: VictimSettings, seed: int):
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
        self._key = jax.random.key(seed)
        self._calls = 0
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, role: ml_collections.ConfigDict, fallback_tokenizer: Tokenizer) -> Victim:
        """The victim a `victim_role_config` section describes (loads its model)."""
        frozen = load_frozen_model(
            role,
            role_name="victim",
            fallback_tokenizer=fallback_tokenizer,
            max_seq_len=role.max_prompt_len + role.max_new_tokens,
            head="lm",
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
        return cls(frozen, settings, seed=role.seed)

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
        texts = self.generate([ids for ids in prompts for _ in range(per_attack)])
        return [texts[i * per_attack : (i + 1) * per_attack] for i in range(len(attacks))]

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """One sampled answer per prompt (token ids), decoded with the victim's tokenizer."""
        settings, tokenizer = self.settings, self.tokenizer
        tokens, mask = pad_sequences_with_mask(
            prompts, settings.max_prompt_len, pad_id=tokenizer.pad_id, left_pad=True
        )
        texts: list[str] = []
        for rows, real in fixed_batches(len(prompts), settings.batch_size):
            out = self._generate(self.frozen.params, tokens[rows], mask[rows], self._next_key())
            generated = np.asarray(jax.device_get(out.tokens))
            texts.extend(tokenizer.decode(generated[row]) for row in range(real))
        return texts

    def _next_key(self) -> jax.Array:
        with self._lock:
            calls, self._calls = self._calls, self._calls + 1
        return jax.random.fold_in(self._key, calls)


# --------------------------------------------------------------------------------- judges


class Judge(Protocol):
    def toxic_logprob(self, attacks: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        """log p(toxic) of each (attack, response) pair: float32 [N]."""
        ...


class Classifier(Protocol):
    num_labels: int
    id2label: Mapping[int, str]

    def logits(self, template: str, fields: Sequence[Mapping[str, str]]) -> np.ndarray:
        """Logits of each filled `template`: float32 [N, num_labels]."""
        ...


def resolve_label(toxic_label: str, id2label: Mapping[int, str], num_labels: int) -> int:
    """The logit index of `toxic_label`: a label name from id2label, or a decimal index."""
    for index, name in id2label.items():
        if name == toxic_label:
            return int(index)
    if toxic_label.isdigit() and int(toxic_label) < num_labels:
        return int(toxic_label)
    raise ValueError(
        f"judge.toxic_label={toxic_label!r} is neither one of the judge's labels "
        f"{dict(id2label)} nor an index below its {num_labels} labels; set it to the name "
        "of the toxic class (e.g. 'hate') or its index."
    )


class EncoderClassifier:
    """A BERT / RoBERTa *ForSequenceClassification checkpoint (`TextEncoder`); texts longer
    than the encoder's max_length are truncated at the end."""

    def __init__(self, encoder, batch_size: int):
        self.encoder = encoder
        self.batch_size = batch_size
        self.id2label = encoder.id2label
        self.num_labels = encoder.config.num_labels

    def logits(self, template: str, fields: Sequence[Mapping[str, str]]) -> np.ndarray:
        texts = [fill_template(template, item) for item in fields]
        return np.asarray(self.encoder.classify(texts, batch_size=self.batch_size), np.float32)


class ScoreHeadClassifier:
    """A decoder with a score head (`FrozenModel` with head="score") as a classifier: the
    scores at each text's last token. An empty text is read at a lone BOS token."""

    def __init__(
        self, frozen: FrozenModel, max_len: int, batch_size: int, id2label: Mapping[int, str]
    ):
        if frozen.model.config.head != "score":
            raise ValueError(
                f"The classifier judge from {frozen.source} has head="
                f"{frozen.model.config.head!r}; it needs a score head (*ForSequenceClassification)."
            )
        check_learned_positions(frozen.model, max_len, "The classifier judge")
        self.frozen = frozen
        self.max_len = max_len
        self.batch_size = batch_size
        self.id2label = dict(id2label)
        self.num_labels = frozen.model.config.num_labels
        self._scores = jax.jit(functools.partial(sequence_scores, frozen.model))

    def logits(self, template: str, fields: Sequence[Mapping[str, str]]) -> np.ndarray:
        tokenizer = self.frozen.tokenizer
        rows = [
            encode_filled(tokenizer, template, item, self.max_len, add_bos=None)
            or [tokenizer.bos_id]
            for item in fields
        ]
        tokens, mask = pad_sequences_with_mask(
            rows, self.max_len, pad_id=tokenizer.pad_id, left_pad=True
        )
        out = np.zeros((len(rows), self.num_labels), np.float32)
        for batch, real in fixed_batches(len(rows), self.batch_size):
            scores = self._scores(self.frozen.params, tokens[batch], mask[batch])
            out[batch[:real]] = np.asarray(jax.device_get(scores))[:real]
        return out


class ClassifierJudge:
    """log_softmax of a classifier's logits at the toxic label (see the module docstring)."""

    def __init__(self, classifier: Classifier, template: str, toxic_label: str):
        if not template_fields(template):
            raise ValueError(
                f"judge.template={template!r} has neither an {{attack}} nor a {{response}} field."
            )
        self.classifier = classifier
        self.template = template
        self.toxic_index = resolve_label(toxic_label, classifier.id2label, classifier.num_labels)

    def toxic_logprob(self, attacks: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        fields = pair_fields(attacks, responses)
        logits = self.classifier.logits(self.template, fields)
        return log_softmax(logits)[:, self.toxic_index].astype(np.float32)


def pair_fields(attacks: Sequence[str], responses: Sequence[str]) -> list[dict[str, str]]:
    if len(attacks) != len(responses):
        raise ValueError(f"Got {len(attacks)} attacks but {len(responses)} responses.")
    return [
        {ATTACK_FIELD: attack, RESPONSE_FIELD: response}
        for attack, response in zip(attacks, responses, strict=True)
    ]


def continuation_logprobs(
    model: Model,
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    continuations: jax.Array,
    continuation_mask: jax.Array,
) -> jax.Array:
    """Teacher-forced log p(continuation c | prompt) for every prompt and candidate c.

    prompt_tokens, prompt_mask: [B, P] (left-padded, P >= 2); continuations,
    continuation_mask: [C, T] (right-padded; mask 1 on real tokens). All but the prompt's
    last token go once into a KV cache (their logits are never formed); each candidate
    then runs as [last prompt token, c_0 .. c_{T-2}] from that cache, whose logits predict
    c_0 .. c_{T-1}. Returns [B, C] float32 (temperature 1).
    """
    batch, prompt_len = prompt_tokens.shape
    num_candidates, length = continuations.shape
    prefix_len = prompt_len - 1
    prompt_mask = prompt_mask.astype(bool)
    positions = positions_from_mask(prompt_mask)
    key_valid = jnp.concatenate([prompt_mask[:, :-1], jnp.ones((batch, length), bool)], axis=1)
    cache = model.init_cache(batch, prefix_len + length)
    _, cache = model.apply(params, prompt_tokens[:, :-1], positions[:, :-1], key_valid, cache, 0)
    chunk_positions = positions[:, -1:] + jnp.arange(length)[None, :]  # [B, T]
    totals = []
    for index in range(num_candidates):
        targets = jnp.broadcast_to(continuations[index], (batch, length))
        inputs = jnp.concatenate([prompt_tokens[:, -1:], targets[:, :-1]], axis=1)
        logits, _ = model.apply(params, inputs, chunk_positions, key_valid, cache, prefix_len)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
        totals.append((logp * continuation_mask[index]).sum(axis=-1))
    return jnp.stack(totals, axis=-1)


class GenerativeJudge:
    """A causal LM judge: log p(unsafe_text) against log p(safe_text) after its prompt."""

    def __init__(
        self,
        frozen: FrozenModel,
        *,
        template: str,
        unsafe_text: str,
        safe_text: str,
        max_prompt_len: int,
        batch_size: int,
    ):
        check_template(template, (RESPONSE_FIELD,), "judge.template")
        if max_prompt_len < 2:
            raise ValueError(f"judge.max_prompt_len={max_prompt_len} must be >= 2.")
        tokenizer = frozen.tokenizer
        candidates = [
            tokenizer.encode(text, add_bos=False, add_eos=False)
            for text in (unsafe_text, safe_text)
        ]
        if not all(candidates) or candidates[0] == candidates[1]:
            raise ValueError(
                f"judge.unsafe_text={unsafe_text!r} and judge.safe_text={safe_text!r} must be "
                "non-empty and encode differently."
            )
        width = max(len(ids) for ids in candidates)
        check_learned_positions(frozen.model, max_prompt_len + width, "The generative judge")
        self.frozen = frozen
        self.template = template
        self.max_prompt_len = max_prompt_len
        self.batch_size = batch_size
        self.candidate_tokens = np.full((2, width), tokenizer.pad_id, np.int32)
        self.candidate_mask = np.zeros((2, width), np.float32)
        for row, ids in enumerate(candidates):
            self.candidate_tokens[row, : len(ids)] = ids
            self.candidate_mask[row, : len(ids)] = 1.0
        self.prompt_ids("", "")  # the template alone must fit: ValueError now, not mid-run
        self._score = jax.jit(functools.partial(continuation_logprobs, frozen.model))

    def prompt_ids(self, attack: str, response: str) -> list[int]:
        return encode_filled(
            self.frozen.tokenizer,
            self.template,
            {ATTACK_FIELD: attack, RESPONSE_FIELD: response},
            self.max_prompt_len,
            add_bos=False,
        )

    def unsafe_and_safe_logprobs(
        self, attacks: Sequence[str], responses: Sequence[str]
    ) -> np.ndarray:
        """[N, 2] float32: log p(unsafe_text), log p(safe_text) after each pair's prompt."""
        rows = [
            self.prompt_ids(item[ATTACK_FIELD], item[RESPONSE_FIELD])
            for item in pair_fields(attacks, responses)
        ]
        pad_id = self.frozen.tokenizer.pad_id
        tokens, mask = pad_sequences_with_mask(
            rows, self.max_prompt_len, pad_id=pad_id, left_pad=True
        )
        out = np.zeros((len(rows), 2), np.float32)
        for batch, real in fixed_batches(len(rows), self.batch_size):
            logp = self._score(
                self.frozen.params,
                tokens[batch],
                mask[batch],
                self.candidate_tokens,
                self.candidate_mask,
            )
            out[batch[:real]] = np.asarray(jax.device_get(logp))[:real]
        return out

    def toxic_logprob(self, attacks: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        logp = self.unsafe_and_safe_logprobs(attacks, responses).astype(np.float64)
        return (logp[:, 0] - np.logaddexp(logp[:, 0], logp[:, 1])).astype(np.float32)


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


def is_encoder_folder(hf_path: str) -> bool:
    """Whether `hf_path`'s config.json names an encoder (not one of the decoder FAMILIES)."""
    from tba_jax.models import hf  # optional: needs safetensors/tokenizers

    return hf.read_hf_config(hf_path).get("model_type") not in FAMILIES


def decoder_id2label(hf_path: str, num_labels: int) -> dict[int, str]:
    """id2label of a decoder classifier's config.json ({} for a random stand-in)."""
    if not hf_path:
        return {}
    from tba_jax.models import hf  # optional: needs safetensors/tokenizers

    labels = hf.read_hf_config(hf_path).get("id2label") or {}
    return {int(index): name for index, name in labels.items() if int(index) < num_labels}


def stand_in_verdict_tokens(role: ml_collections.ConfigDict, tokenizer: Tokenizer) -> int:
    """The longest verdict in a random stand-in judge's (the policy's) tokens; 0 for a
    checkpoint, whose own config sets its positions."""
    if role.hf_path:
        return 0
    texts = (role.unsafe_text, role.safe_text)
    return max(len(tokenizer.encode(text, add_bos=False, add_eos=False)) for text in texts)


def judge_from_config(role: ml_collections.ConfigDict, fallback_tokenizer: Tokenizer) -> Judge:
    """The judge a `judge_role_config` section describes (loads its model)."""
    if role.kind == "generative":
        frozen = load_frozen_model(
            role,
            role_name="judge",
            fallback_tokenizer=fallback_tokenizer,
            max_seq_len=role.max_prompt_len + stand_in_verdict_tokens(role, fallback_tokenizer),
            head="lm",
        )
        return GenerativeJudge(
            frozen,
            template=role.template,
            unsafe_text=role.unsafe_text,
            safe_text=role.safe_text,
            max_prompt_len=role.max_prompt_len,
            batch_size=role.batch_size,
        )
    if role.hf_path and is_encoder_folder(role.hf_path):
        from tba_jax.models.encoder import TextEncoder

        encoder = TextEncoder.from_pretrained(role.hf_path, dtype=role.dtype)
        classifier = EncoderClassifier(encoder, role.batch_size)
    else:
        frozen = load_frozen_model(
            role,
            role_name="judge",
            fallback_tokenizer=fallback_tokenizer,
            max_seq_len=role.max_prompt_len,
            head="score",
            num_labels=role.num_labels,
        )
        num_labels = frozen.model.config.num_labels
        classifier = ScoreHeadClassifier(
            frozen, role.max_prompt_len, role.batch_size, decoder_id2label(role.hf_path, num_labels)
        )
    return ClassifierJudge(classifier, role.template, role.toxic_label)


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
    for key in ("num_responses", "max_new_tokens"):
        if victim[key] < 1:
            raise ConfigError(f"task.victim.{key}={victim[key]} must be >= 1.")
    if not (victim.temperature > 0 and 0 < victim.top_p <= 1 and math.isfinite(victim.temperature)):
        raise ConfigError(
            f"task.victim.temperature={victim.temperature} must be > 0 and top_p={victim.top_p} "
            "in (0, 1]."
        )
