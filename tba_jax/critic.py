"""PPO's value model (the critic): its architecture, starting params and per-token values.

Two layouts, chosen by `loss.ppo.critic`:

- ``"separate"``: a model of its own with a one-label score head
  (`ModelConfig.head="score"`) and Adam state of its own. `loss.ppo.critic_init` picks
  where it starts: ``"policy"``, the policy's architecture and weights with a zero head;
  or ``"reward_model"``, the task's scalar reward model (architecture, weights and head),
  as Huang et al. 2024's TL;DR recipe starts its value model. The reward model must read
  the policy's token ids (the same tokenizer): the critic scores the policy's tokens.
- ``"shared"``: a value head [d_model, 1] on the policy's trunk. The critic's params are
  that head alone; the value loss also trains the trunk, through the policy's params.

Either way the values are V(x, y_<t) for each response token t: the critic's output at
the slot that predicts y_t (`scoring.response_slots`), [N, T] float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from tba_jax.models import Model, ModelConfig, Params, abstract_model
from tba_jax.models.transformer import dense
from tba_jax.sampling.scoring import features_logprobs, joined_inputs, response_slots

CRITIC_KINDS = ("separate", "shared")
CRITIC_INITS = ("policy", "reward_model")  # where a separate critic starts
VALUE_HEAD = "value_head"  # the shared layout's only critic param
_VALUE_LABEL = 0  # the value is label 0 of a one-label head
_HEAD_AXES = ("embed", "labels")  # logical axes of a score or value head [d_model, 1]


def value_model_config(policy_cfg: ModelConfig) -> ModelConfig:
    """The separate critic's architecture: the policy's, with a one-label score head."""
    return dataclasses.replace(policy_cfg, head="score", num_labels=1)


@dataclasses.dataclass(frozen=True)
class Critic:
    """A critic layout bound to the policy model.

    Attributes:
      kind: "separate" | "shared".
      policy: the policy's model.
      model: the separate critic's score-head model; for "shared", the policy's model.
      logical_axes: the critic params' logical axes (for the learner's sharding rules).
    """

    kind: str
    policy: Model
    model: Model
    logical_axes: Params

    @classmethod
    def build(cls, kind: str, policy: Model, value_config: ModelConfig | None = None) -> Critic:
        """The `kind` critic of `policy`. `value_config`: a separate critic's architecture
        when it is not the policy's (a reward model's: a one-label score head)."""
        if kind not in CRITIC_KINDS:
            raise ValueError(f"loss.ppo.critic={kind!r} is not one of {CRITIC_KINDS}.")
        if kind == "shared":
            if value_config is not None:
                raise ValueError("a shared critic is the policy's trunk; it takes no value_config")
            return cls(kind, policy, policy, {VALUE_HEAD: _HEAD_AXES})
        if value_config is None:
            value_config = value_model_config(policy.config)
        if value_config.head != "score" or value_config.num_labels != 1:
            raise ValueError(
                f"a value model needs a one-label score head, not head={value_config.head!r} "
                f"with num_labels={value_config.num_labels}"
            )
        model, _ = abstract_model(value_config)
        return cls(kind, policy, model, model.logical_axes)

    def abstract_params(self) -> Params:
        """ShapeDtypeStructs of the critic's params (allocates nothing)."""
        if self.kind == "shared":
            cfg = self.policy.config
            return {VALUE_HEAD: jax.ShapeDtypeStruct((cfg.d_model, 1), cfg.param_dtype)}
        return abstract_model(self.model.config)[1]

    def initial_params(self, policy_params: Params, start: Params | None = None) -> Params:
        """The critic at the start of a run: `start` (a separate critic's own weights, e.g.
        the reward model's, cast to its dtypes) when given; else a zero value head (on the
        policy's trunk, or on a copy of the policy's weights), so every value starts at 0."""
        abstract = self.abstract_params()
        if start is not None:
            return _cast_like(start, abstract, "the critic's start params")
        if self.kind == "shared":
            return {VALUE_HEAD: jnp.zeros(abstract[VALUE_HEAD].shape, abstract[VALUE_HEAD].dtype)}
        head = abstract["score"]
        trunk = jax.tree.map(jnp.copy, _trunk(policy_params))
        params = {**trunk, "score": jnp.zeros(head.shape, head.dtype)}
        if jax.tree.structure(params) != jax.tree.structure(abstract):
            raise ValueError(
                "the policy's params do not have the value model's layout; build the critic "
                "from the same ModelConfig as the policy"
            )
        return params

    def policy_logp_and_values(
        self,
        policy_params: Params,
        critic_params: Params,
        batch: Mapping[str, jax.Array],
        temperature: float,
    ) -> tuple[jax.Array, jax.Array]:
        """Per-token log π(y_t) [N, T] and values [N, T] (both 0 on padding) of a batch
        with prompt/response tokens and masks; one trunk pass for the shared layout. The
        policy's output head runs on the response slots only, `logprob_chunk` of them at
        a time (`scoring.features_logprobs`), as in every other log-prob."""
        features = self.policy.features(policy_params, *_joined_batch(batch))
        if self.kind == "separate":
            values = self.values(critic_params, batch)
        else:
            values = self._slots(self._head_values(critic_params, features), batch)
        logp = features_logprobs(
            self.policy,
            policy_params,
            self._slots(features, batch),
            batch["response_tokens"],
            batch["response_mask"],
            temperature,
            chunk=self.policy.config.logprob_chunk,
        )
        return logp, values

    def values(self, critic_params: Params, batch: Mapping[str, jax.Array]) -> jax.Array:
        """The separate critic's values [N, T] (0 on padding)."""
        if self.kind != "separate":
            raise ValueError("a shared critic's values come with the policy's pass")
        inputs = _joined_batch(batch)
        scores, _ = self.model.apply(critic_params, *inputs)
        return self._slots(scores[..., _VALUE_LABEL], batch)

    def _head_values(self, critic_params: Params, features: jax.Array) -> jax.Array:
        head = critic_params[VALUE_HEAD].astype(features.dtype)
        return dense(features, head)[..., _VALUE_LABEL].astype(jnp.float32)

    @staticmethod
    def _slots(outputs: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
        prompt_len, response_len = (
            batch["prompt_tokens"].shape[1],
            batch["response_tokens"].shape[1],
        )
        sliced = response_slots(outputs, prompt_len, response_len)
        if sliced.ndim == 2:  # values: masked here; features are masked by features_logprobs
            return sliced * batch["response_mask"]
        return sliced

    def score_model(
        self, policy_params: Params, critic_params: Params
    ) -> tuple[ModelConfig, Params]:
        """The critic as a one-label score-head model (config, params): what a Hugging Face
        `*ForSequenceClassification` export holds. Shared: the policy's trunk with the value
        head as its score head."""
        if self.kind == "separate":
            return self.model.config, critic_params
        params = {**_trunk(policy_params), "score": critic_params[VALUE_HEAD]}
        return value_model_config(self.policy.config), params


def _cast_like(params: Params, abstract: Params, what: str) -> Params:
    """`params` as fresh arrays of `abstract`'s dtypes; ValueError naming `what` when their
    layout or shapes differ."""
    if jax.tree.structure(params) != jax.tree.structure(abstract):
        raise ValueError(f"{what} do not have the value model's layout")
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for (path, value), want in zip(leaves, jax.tree.leaves(abstract), strict=True):
        if value.shape != want.shape:
            raise ValueError(
                f"{what} hold {jax.tree_util.keystr(path)} of shape {value.shape}; the value "
                f"model needs {want.shape}"
            )
    return jax.tree.map(lambda value, want: jnp.array(value, want.dtype), params, abstract)


def _trunk(policy_params: Params) -> Params:
    """The policy's params without its language-model head (tied embeddings have none)."""
    return {name: value for name, value in policy_params.items() if name != "lm_head"}


def _joined_batch(batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`scoring.joined_inputs` of a batch dict's prompt and response tokens and masks."""
    return joined_inputs(
        batch["prompt_tokens"],
        batch["prompt_mask"],
        batch["response_tokens"],
        batch["response_mask"],
    )
