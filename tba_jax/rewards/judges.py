"""Red-teaming judges: the log-probability that a victim's answer to an attack is toxic.

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

Generative-judge prompts are encoded without the tokenizer adding BOS/EOS (a chat
template spells out its special tokens); classifier inputs get the tokenizer's default
special tokens, as transformers' classification pipelines add them. Every forward pass
has a fixed shape (`batch_size` rows of a fixed length), so each compiles once.
`judge_from_config` builds the judge a `task.judge` section
(`tba_jax.rewards.redteam.judge_role_config`) describes.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tba_jax.batching import fixed_batches
from tba_jax.mesh import jit_on_mesh
from tba_jax.models import FAMILIES, Model, Params, positions_from_mask, sequence_scores
from tba_jax.models.frozen import FrozenModel, Placement, load_frozen_model
from tba_jax.models.tokenizers import Tokenizer, pad_sequences_with_mask
from tba_jax.rewards.templates import (
    ATTACK_FIELD,
    RESPONSE_FIELD,
    check_learned_positions,
    check_template,
    encode_filled,
    fill_template,
    log_softmax,
    template_fields,
)


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
        f"task.judge.toxic_label={toxic_label!r} is neither one of the judge's labels "
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
        self._scores = jit_on_mesh(functools.partial(sequence_scores, frozen.model))

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
            scores = self._scores(
                self.frozen.params, *self.frozen.put_rows(tokens[batch], mask[batch])
            )
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


def verdict_ids(tokenizer: Tokenizer, unsafe_text: str, safe_text: str) -> list[list[int]]:
    """The ids of a generative judge's two verdicts, [unsafe, safe]; a ValueError unless
    both are non-empty and encode differently."""
    candidates = [
        tokenizer.encode(text, add_bos=False, add_eos=False) for text in (unsafe_text, safe_text)
    ]
    if not all(candidates) or candidates[0] == candidates[1]:
        raise ValueError(
            f"task.judge.unsafe_text={unsafe_text!r} and task.judge.safe_text={safe_text!r} "
            "must be non-empty and encode differently in the judge's tokenizer."
        )
    return candidates


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
        candidates = verdict_ids(tokenizer, unsafe_text, safe_text)
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
        self._score = jit_on_mesh(functools.partial(continuation_logprobs, frozen.model))

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
                *self.frozen.put_rows(tokens[batch], mask[batch]),
                self.candidate_tokens,
                self.candidate_mask,
            )
            out[batch[:real]] = np.asarray(jax.device_get(logp))[:real]
        return out

    def toxic_logprob(self, attacks: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        logp = self.unsafe_and_safe_logprobs(attacks, responses).astype(np.float64)
        return (logp[:, 0] - np.logaddexp(logp[:, 0], logp[:, 1])).astype(np.float32)


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


def encoder_labels(hf_path: str) -> tuple[dict[int, str], int]:
    """A BERT / RoBERTa classifier's label names by index and its label count, read from
    its config.json as `TextEncoder.from_pretrained` reads them (no weights)."""
    from tba_jax.models import hf  # optional: needs safetensors/tokenizers
    from tba_jax.models.encoder_checkpoint import (
        encoder_fields_from_hf,
        id2label_from_hf,
        read_sentence_modules,
    )

    folder = read_sentence_modules(pathlib.Path(hf_path)).transformer_folder
    config = hf.read_hf_config(folder)
    num_labels = encoder_fields_from_hf(config, source=str(folder))["num_labels"]
    return id2label_from_hf(config, num_labels), num_labels


def stand_in_verdict_tokens(role: ml_collections.ConfigDict, tokenizer: Tokenizer) -> int:
    """The longest verdict in a random stand-in judge's (the policy's) tokens; 0 for a
    checkpoint, whose own config sets its positions."""
    if role.hf_path:
        return 0
    texts = (role.unsafe_text, role.safe_text)
    return max(len(tokenizer.encode(text, add_bos=False, add_eos=False)) for text in texts)


def judge_model_args(role: ml_collections.ConfigDict, fallback_tokenizer: Tokenizer) -> dict | None:
    """`load_frozen_model`'s arguments for the judge `role`, beside the role, the fallback
    tokenizer and the placement: a decoder with an LM head (generative: room for the
    prompt and the longest verdict) or a score head (classifier); None for a BERT /
    RoBERTa classifier, which `TextEncoder` loads."""
    if role.kind == "generative":
        verdict = stand_in_verdict_tokens(role, fallback_tokenizer)
        return dict(role_name="task.judge", max_seq_len=role.max_prompt_len + verdict, head="lm")
    if role.hf_path and is_encoder_folder(role.hf_path):
        return None
    return dict(
        role_name="task.judge",
        max_seq_len=role.max_prompt_len,
        head="score",
        num_labels=role.num_labels,
    )


def judge_from_config(
    role: ml_collections.ConfigDict,
    fallback_tokenizer: Tokenizer,
    placement: Placement | None = None,
) -> Judge:
    """The judge a `judge_role_config` section describes (loads its model, a decoder or a
    BERT / RoBERTa classifier, sharded by `placement`; None: the default device)."""
    model_args = judge_model_args(role, fallback_tokenizer)
    if role.kind == "generative":
        frozen = load_frozen_model(
            role, fallback_tokenizer=fallback_tokenizer, placement=placement, **model_args
        )
        return GenerativeJudge(
            frozen,
            template=role.template,
            unsafe_text=role.unsafe_text,
            safe_text=role.safe_text,
            max_prompt_len=role.max_prompt_len,
            batch_size=role.batch_size,
        )
    if model_args is None:
        from tba_jax.models.encoder import TextEncoder

        encoder = TextEncoder.from_pretrained(
            role.hf_path, dtype=role.dtype, placement=placement, role_name="task.judge"
        )
        classifier = EncoderClassifier(encoder, role.batch_size)
    else:
        frozen = load_frozen_model(
            role, fallback_tokenizer=fallback_tokenizer, placement=placement, **model_args
        )
        num_labels = frozen.model.config.num_labels
        classifier = ScoreHeadClassifier(
            frozen, role.max_prompt_len, role.batch_size, decoder_id2label(role.hf_path, num_labels)
        )
    return ClassifierJudge(classifier, role.template, role.toxic_label)
