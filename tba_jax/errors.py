"""The error a user fixes by changing a setting: launchers (`cli.run`'s `user_errors`) print
it as one line, never as a traceback. It lives apart from `config_lib` so that low-level
modules (`mesh`) can raise it; `config_lib.ConfigError` is the same class."""


class ConfigError(ValueError):
    """A config value that cannot work; the message says which and what to do."""
