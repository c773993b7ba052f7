"""Helpers shared by several test files (not collected: the name has no test_ prefix)."""

import textwrap

# Python source that hides TensorFlow from every import finder: afterwards `import tensorflow`
# raises ModuleNotFoundError and find_spec returns None, exactly as if it were not installed.
# Prepend it to a script run in a subprocess to prove code works without TensorFlow.
HIDE_TENSORFLOW = textwrap.dedent(
    """
    import importlib.util, json, sys

    class HideTensorFlow:
        def __init__(self, finder):
            self._finder = finder

        def find_spec(self, name, path=None, target=None):
            if name == "tensorflow" or name.startswith("tensorflow."):
                return None
            return self._finder.find_spec(name, path, target)

        def __getattr__(self, attribute):
            return getattr(self._finder, attribute)

    sys.meta_path[:] = [HideTensorFlow(finder) for finder in sys.meta_path]
    assert importlib.util.find_spec("tensorflow") is None
    """
)
