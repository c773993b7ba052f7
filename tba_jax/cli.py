"""Shared pieces of the absl command-line launchers in experiments/."""

from __future__ import annotations

import re
import sys

from absl import flags

from tba_jax.config_lib import ConfigError


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parser, with a bad `--config` reported in one line instead of a traceback.

    Use as `app.run(main, flags_parser=parse_flags)`.
    """
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        # A ConfigError raised inside get_config reaches us as text in absl's message.
        found = re.search(rf"{ConfigError.__name__}: (.*)", str(error))
        sys.exit(f"error: {found.group(1) if found else error}")
    except (AttributeError, KeyError) as error:
        # ml_collections reports an unknown `--config.a.b=v` key as a bare key name.
        key = str(error).strip("\"'")
        pattern = rf"--config\.(.*\.)?{re.escape(key)}(=|$)"
        overrides = [arg for arg in argv if re.match(pattern, arg)]
        where = f" in {overrides[0]}" if overrides else ""
        sys.exit(f"error: unknown config key {key!r}{where}; see the config file for the keys.")
