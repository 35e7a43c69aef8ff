"""The one table of differences between the model families ctxrelay runs.

Everything family-specific that the runner, the capture code and the transports need lives
here; nowhere else branches on `model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    # q_norm / k_norm (RMSNorm over head_dim) applied after projection, before RoPE.
    qk_norm: bool
    # Gemma's "sandwich": post_attention_layernorm is applied to the attention output before the
    # residual add, and the MLP is wrapped in pre_/post_feedforward_layernorm.
    sandwich_norm: bool
    # Attention scale = attn_scale_key ** -0.5 where the key names a config field; None = head_dim.
    attn_scale_field: str | None
    # Config field holding the attention-logit soft cap (tanh capping), None if the family has none.
    softcap_field: str | None
    # RoPE tables depend on the layer type (gemma3: local base 10k for sliding layers, 1M global).
    rope_per_layer_type: bool
    # Layers whose type is "sliding_attention" only see the last `sliding_window` keys.
    sliding_window_from_layer_types: bool


FAMILIES: dict[str, Family] = {
    "llama": Family(
        name="llama",
        qk_norm=False,
        sandwich_norm=False,
        attn_scale_field=None,
        softcap_field=None,
        rope_per_layer_type=False,
        sliding_window_from_layer_types=False,
    ),
    "qwen2": Family(
        name="qwen2",
        qk_norm=False,
        sandwich_norm=False,
        attn_scale_field=None,
        softcap_field=None,
        rope_per_layer_type=False,
        sliding_window_from_layer_types=True,
    ),
    "gemma3_text": Family(
        name="gemma3",
        qk_norm=True,
        sandwich_norm=True,
        attn_scale_field="query_pre_attn_scalar",
        softcap_field="attn_logit_softcapping",
        rope_per_layer_type=True,
        sliding_window_from_layer_types=True,
    ),
}


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise ValueError(
            f"model_type {model_type!r} is not supported by ctxrelay (supported: {known}); "
            "add a row to ctxrelay.models.families.FAMILIES"
        ) from None
