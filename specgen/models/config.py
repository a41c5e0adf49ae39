"""ModelConfig: the architecture hyper-parameters every loader produces and the runtime consumes (MoeConfig: a
mixture-of-experts model's routing)."""
from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Ernie4_5_ForCausalLM": "ernie4_5",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoeConfig:
    """The routed experts of a mixture-of-experts model (transformers' Qwen3MoeSparseMoeBlock and
    Ernie4_5_MoeSparseMoeBlock): per token, probs = softmax(router logits); the top_k experts by probs (+ the
    selection bias, ERNIE's e_score_correction_bias, which picks experts but does not weight them); their
    probs as weights, divided by max(their sum, norm_min) when norm_topk_prob; the output is the weighted sum
    of the chosen experts' SwiGLU MLPs, plus the shared experts' (a dense MLP of
    num_shared_experts * intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # the blocks whose MLP is routed (the others are dense, of ModelConfig.intermediate_size)
    layers: tuple[int, ...]
    norm_topk_prob: bool
    norm_min: float = 0.0  # ERNIE's moe_norm_min
    num_shared_experts: int = 0
    selection_bias: bool = False  # ERNIE: mlp.moe_statics.e_score_correction_bias


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only Llama-family model.

    Weight layout conventions (HF names, HF [out, in] layout) are those of `transformers`' Llama.
    """

    architecture: str  # one of ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # qwen2; ernie4_5 with use_bias
    o_bias: bool = False  # ernie4_5 with use_bias
    mlp_bias: bool = False  # ernie4_5 with use_bias
    qk_norm: bool = False  # qwen3: RMSNorm on each head of q and k before RoPE
    rope_interleaved: bool = False  # rotate pairs (2i, 2i+1) instead of halves (GPT-J style)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoeConfig | None = None  # qwen3_moe, ernie4_5_moe

    @classmethod
    def from_dict(cls, fields: dict) -> "ModelConfig":
        """From dataclasses.asdict's form read back from JSON (nested configs as dicts, tuples as lists)."""
        fields = dict(fields)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        if fields.get("moe") is not None:
            fields["moe"] = MoeConfig(**dict(fields["moe"], layers=tuple(fields["moe"]["layers"])))
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        return cls(**fields)
