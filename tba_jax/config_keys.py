"""The keys of a config, listed and looked up by a near spelling.

`leaf_items(config)` lists every knob as (dotted key, value), the way `--config.a.b=v`
overrides and `:a.b=v` variant items name them; `unknown_key_message(config, key)` is the
one-line error for a key the config does not have, naming the nearest key it does have.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import ml_collections

# difflib's similarity ratio (0..1) above which a known key is offered as the likely one.
SIMILARITY_CUTOFF = 0.6


def leaf_items(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every value of `config`, sorted by key; an empty section is
    one item with the value {}."""
    items = []
    for name in sorted(config.keys()):
        key, value = f"{prefix}{name}", config[name]
        if isinstance(value, ml_collections.ConfigDict) and value.keys():
            items += leaf_items(value, prefix=f"{key}.")
        elif isinstance(value, ml_collections.ConfigDict):
            items.append((key, {}))
        else:
            items.append((key, value))
    return items


def lookup(config: ml_collections.ConfigDict, key: str) -> tuple[bool, Any]:
    """(whether the dotted `key` names a value or a section of `config`, what it names)."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def has_key(config: ml_collections.ConfigDict, key: str) -> bool:
    """Whether the dotted `key` names a value or a section of `config`."""
    return lookup(config, key)[0]


def _last_part(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def nearest_key(
    config: ml_collections.ConfigDict, key: str, shortcuts: Mapping[str, str] | None = None
) -> str | None:
    """The key of `config` (or, for a variant item, of its `shortcuts`) most like `key`: by
    the whole dotted key first (a typo anywhere), else by the last part alone (a key given
    without its section); None if none is close."""
    known = [*(shortcuts or {}), *(name for name, _ in leaf_items(config))]
    close = difflib.get_close_matches(key, known, n=1, cutoff=SIMILARITY_CUTOFF)
    if close:
        return close[0]
    by_last_part = {}
    for name in known:
        by_last_part.setdefault(_last_part(name), name)
    close = difflib.get_close_matches(
        _last_part(key), list(by_last_part), n=1, cutoff=SIMILARITY_CUTOFF
    )
    return by_last_part[close[0]] if close else None


def unknown_key_message(
    config: ml_collections.ConfigDict, key: str, shortcuts: Mapping[str, str] | None = None
) -> str:
    """The one-line error for `key`, e.g. unknown config key 'optim.learning_rat'; did you
    mean 'optim.learning_rate'? (a variant item's `shortcuts` are suggested as well, e.g.
    'steps' (learner_steps) for 'step')."""
    shortcuts = shortcuts or {}
    suggestion = nearest_key(config, key, shortcuts)
    if suggestion in shortcuts:
        hint = f"did you mean {suggestion!r} ({shortcuts[suggestion]})?"
    elif suggestion:
        hint = f"did you mean {suggestion!r}?"
    else:
        hint = "--print_config lists every key."
    return f"unknown config key {key!r}; {hint}"
