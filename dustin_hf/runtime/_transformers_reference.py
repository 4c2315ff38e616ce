"""Verbatim copies of transformers code, for the bytecode checks of :mod:`dustin_hf.runtime.recognise`.

Nothing in this module runs. :mod:`~dustin_hf.runtime.recognise` compares the instructions, names and constants a
model's code compiles to with these copies (docstrings' text aside) before :func:`dustin_hf.runtime.fused.fused_ops`
replaces or bypasses that code:

* :class:`StandardRMSNorm` -- the forward of the RMSNorm classes in ``recognise._RMS_NORM_CLASSES``;
* :func:`rotate_half`, :func:`apply_rotary_pos_emb` -- a modeling module's globals of those names (Llama,
  Mistral, Qwen2, Qwen3 and the MoE variants);
* :class:`StandardMLP` -- the forward of ``recognise._MLP_CLASSES``;
* :class:`StandardDecoderLayer`, :class:`StandardDecoderLayer524` -- the forward of
  ``recognise._DECODER_LAYER_CLASSES`` (before and from 5.24, which names the cache argument ``cache``).

Checked on transformers 5.17, 5.23, 5.24 and 5.25 (:data:`dustin_hf.compat.VERIFIED_RANGE`). Where a release
compiles a listed class or function to other code, that part keeps transformers' own code, with one warning per
process naming it (:func:`dustin_hf.runtime.recognise._warn_unrecognised`): the outputs stay transformers', only
launches are saved elsewhere.
"""

from __future__ import annotations

import torch


class StandardRMSNorm:
    """transformers' RMSNorm forward, verbatim (``_RMS_NORM_CLASSES``, 5.17 to 5.25): the bytecode
    a class's forward must compile to before its instances are replaced."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


# transformers' rotate_half and apply_rotary_pos_emb (Llama/Mistral/Qwen2/Qwen3 and MoE variants, 5.17 to
# 5.25), verbatim but for the docstrings' text.
def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Applies Rotary Position Embedding to the query and key tensors."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class StandardMLP:
    """transformers' gated MLP forward, verbatim (``_MLP_CLASSES``, 5.17 to 5.25)."""

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class StandardDecoderLayer:
    """transformers' decoder-layer forward, verbatim (``_DECODER_LAYER_CLASSES``, 5.17 and 5.23; its form from 5.24
    names the cache ``cache``, :class:`StandardDecoderLayer524`). The forward has no docstring (one is a constant of
    its code object)."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class StandardDecoderLayer524:
    """The same forward as transformers 5.24 writes it (the cache argument is ``cache``)."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states
