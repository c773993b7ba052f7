"""Prompt templates of the red-teaming roles: `{attack}` and `{response}` fields.

Fields are filled in one pass (a field's own text is never substituted into); nothing
else is special, so braces may appear. `encode_filled` encodes a filled template within
a token budget, shortening the longest field from its end until it fits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from tba_jax.models import Model
from tba_jax.models.tokenizers import Tokenizer

ATTACK_FIELD = "attack"


RESPONSE_FIELD = "response"


_FIELD_PATTERN = re.compile(r"\{(attack|response)\}")


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
    length_key: str = "the max_prompt_len of this role",
) -> list[int]:
    """Ids of the filled `template`, at most `max_len` of them.

    While the encoding is too long, the field with the most tokens loses as many tokens
    from its end as the encoding is over (re-encoding the joined text can merge tokens
    differently, hence the loop; each round shortens a field, so it ends). `add_bos`: as
    `Tokenizer.encode` (None: the tokenizer's default); EOS is never added. ValueError
    when the template with empty fields is already longer than `max_len`, advising to
    raise `length_key` (e.g. "task.judge.max_prompt_len").
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
                f"max_len={max_len}; raise {length_key}."
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
