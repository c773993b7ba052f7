"""`EncoderConfig`: the architecture of a BERT / RoBERTa checkpoint (from its config.json).

Read from a folder by `encoder_checkpoint.encoder_fields_from_hf`; run by `encoder`.
"""

from __future__ import annotations

import dataclasses

from tba_jax.models.config import DTYPES

FAMILIES = ("bert", "roberta")
HEADS = ("base", "classifier")
# config.json's hidden_act values the encoder implements (`encoder.ACTIVATIONS`).
ACTIVATION_NAMES = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """The architecture of a BERT / RoBERTa checkpoint (from its config.json).

    `head`: "base" (BertModel / RobertaModel: hidden states only) or "classifier"
    (*ForSequenceClassification: `num_labels` logits from the first token).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    activation: str
    head: str
    num_labels: int
    dtype: str = "float32"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}; supported encoder families: {FAMILIES}.")
        if self.head not in HEADS:
            raise ValueError(f"head={self.head!r}; expected one of {HEADS}.")
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(
                f"hidden_act={self.activation!r} is not supported; "
                f"the encoder implements {sorted(ACTIVATION_NAMES)}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected one of {sorted(DTYPES)}.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_heads}."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_offset(self) -> int:
        """The position id of the first token (RoBERTa counts from pad_token_id + 1)."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def max_tokens(self) -> int:
        """The longest input the position embeddings can hold."""
        return self.max_position_embeddings - self.position_offset
