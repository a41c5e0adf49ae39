"""read_gguf / load_gguf: a llama.cpp GGUF file -> its config, tokenizer and the place of each tensor; a
Checkpoint whose tensors are read from the file (float32 HF layout, or the raw blocks) when asked for."""
from __future__ import annotations

import dataclasses
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from specgen.errors import CheckpointError
from specgen.models.checkpoint import (
    QUANT_BLOCK_BYTES,
    QUANT_BLOCK_WEIGHTS,
    Checkpoint,
    Lazy,
    QuantRows,
    read_range,
)
from specgen.models.config import ModelConfig, MoeConfig
from specgen.models.gguf_header import TensorInfo, read_header
from specgen.models.tokenizer import TextTokenizer

# general.architecture -> ModelConfig.architecture. Mistral models are written by llama.cpp as "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "ernie4_5": "ernie4_5", "ernie4_5-moe": "ernie4_5_moe"}
# ERNIE-4.5 rotates interleaved pairs in HF too, and llama.cpp's converter writes its q/k rows as they are.
_ERNIE = {"ernie4_5", "ernie4_5-moe"}
# llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) reorders the q/k rows of these
# architectures from HF's rotate-half order into interleaved-pair order; the Qwen converters do not.
_PERMUTED_QK = {"llama"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",  # ernie4_5 with use_bias
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a routed block's router [num_experts, hidden]
    # ernie4_5-moe: the shared experts (one dense MLP of expert_shared_count experts' width), and the bias
    # that picks experts without weighting them (HF [1, num_experts]; llama.cpp's exp_probs_b, [num_experts])
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias",
}
_SELECTION_BIAS = "mlp.moe_statics.e_score_correction_bias"
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")
# A mixture-of-experts block (llama.cpp's qwen3moe): each projection of every expert stacked in one tensor
# [num_experts, out, in] (GGUF ne: in, out, experts), split here into HF's experts.{e}.* tensors.
_STACKED_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                    "ffn_down_exps.weight": "down_proj"}

# tokenizer.ggml.pre -> pre-tokenizer. The regexes are those of llama.cpp's llama-vocab.cpp for the same
# pre type, written the way each model's HF tokenizer.json spells them.
_GPT2_DIGITS_PRE = {"smollm", "starcoder", "refact"}  # \p{N} split first, then the GPT-2 regex
_GPT2_PRE = {"gpt-2", "mpt", "olmo"}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLIT_PRE = {"llama-bpe": _LLAMA3_REGEX, "smaug-bpe": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}
SUPPORTED_PRE = sorted(_GPT2_DIGITS_PRE | _GPT2_PRE | set(_SPLIT_PRE))
# Chat end-of-turn markers: added to eos_token_ids when the chat template writes them.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")
_CONTROL, _USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
_NORMAL, _UNKNOWN, _BYTE = int(gguf.TokenType.NORMAL), int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.BYTE)


@dataclass(frozen=True)
class StoredTensor:
    """Where one HF-named tensor lies in a GGUF file: bytes [offset, offset + nbytes) of GGML type `kind`,
    its HF shape, and, for llama's q/k rows, the head count whose llama.cpp row order is undone (0: none)."""

    offset: int
    nbytes: int
    kind: str
    shape: tuple[int, ...]
    unpermute: int = 0

    @property
    def has_blocks(self) -> bool:
        """A 2-D weight stored in a block format the kernels multiply by directly."""
        return (self.kind in QUANT_BLOCK_BYTES and len(self.shape) == 2
                and self.shape[1] % QUANT_BLOCK_WEIGHTS[self.kind] == 0)

    def blocks(self, path: Path) -> QuantRows:
        """uint8 [out, in / block weights, block bytes], read from the file (q/k rows put back in order)."""
        out, inp = self.shape
        b = read_range(path, self.offset, self.nbytes).reshape(out, inp // QUANT_BLOCK_WEIGHTS[self.kind],
                                                               QUANT_BLOCK_BYTES[self.kind])
        return QuantRows(self.kind, unpermute_qk(b, self.unpermute) if self.unpermute else b)

    def values(self, path: Path) -> np.ndarray:
        """The tensor dequantized to float32 (exactly as gguf.quants does), HF shape."""
        rows = self.shape[0] if len(self.shape) == 2 else 1
        raw = read_range(path, self.offset, self.nbytes).reshape(rows, -1)
        qtype = gguf.GGMLQuantizationType[self.kind]
        w = np.empty((rows, int(np.prod(self.shape)) // rows), np.float32)
        step = max(1, (1 << 22) // w.shape[1])  # rows at a time: gguf's temporaries are a few times theirs
        for r in range(0, rows, step):
            w[r:r + step] = dequantize(raw[r:r + step], qtype)
        w = w.reshape(self.shape)
        return unpermute_qk(w, self.unpermute) if self.unpermute else w


@dataclass
class GgufModel:
    """What a GGUF file holds, read from its metadata: config, tokenizer, and where each tensor lies. Its
    tensors are read from the file only when a load asks for them (`checkpoint`): nothing is copied at load,
    on disk or in memory."""

    path: Path
    config: ModelConfig
    tokenizer: TextTokenizer | None
    tensors: dict[str, StoredTensor]

    def checkpoint(self, source: str | None = None) -> Checkpoint:
        t, path = self.tensors, self.path
        return Checkpoint(
            config=self.config, tokenizer=self.tokenizer, source=source or str(path),
            weights=Lazy({n: s.shape for n, s in t.items()}, lambda n: t[n].values(path)),
            quantized=Lazy({n: s.kind for n, s in t.items() if s.has_blocks}, lambda n: t[n].blocks(path)))


def load_gguf(path: str | Path) -> Checkpoint:
    """`path` as a Checkpoint whose tensors are read (dequantized, renamed) when asked for."""
    return read_gguf(path).checkpoint()


def read_gguf(path: str | Path) -> GgufModel:
    """Read `path`'s metadata: its ModelConfig, tokenizer, and each tensor's place, checked."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    try:
        header = read_header(path)
    except (OSError, ValueError, IndexError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
    meta = _Metadata(header.fields, path)
    arch_name = meta.require("general.architecture")
    if arch_name not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch_name!r} is not supported; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    stored = _index(header.tensors, path)
    shapes = {n: s.shape for n, s in stored.items()}
    config = _build_config(meta, arch_name, shapes, tokens)
    _check_tensors(shapes, config, path)
    if arch_name in _PERMUTED_QK:
        for i in range(config.num_layers):
            for proj, num in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                for kind in ("weight", "bias"):
                    name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                    if name in stored:
                        stored[name] = dataclasses.replace(stored[name], unpermute=num)
    return GgufModel(path, config, _build_tokenizer(meta, path), stored)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (same as transformers' GGUF loader `_reverse_permute_weights`).

    llama.cpp stored rows in order reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2), i.e. the rotate-half
    pair (j, j + head_dim/2) of each head as adjacent rows (2j, 2j+1); this puts them back.
    """
    rows = w.shape[0]  # w: [num_heads * head_dim, hidden_size] or bias [num_heads * head_dim]
    head_dim = rows // num_heads
    out = w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2)  # [heads, 2, head_dim/2, ...]
    return np.ascontiguousarray(out.reshape(w.shape))


class _Metadata:
    """Typed access to the GGUF key/value metadata, with errors naming the file and key."""

    def __init__(self, fields: dict[str, Any], path: Path):
        self._fields = fields  # gguf_header.read_header's
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, list):  # per-layer head counts (e.g. OpenELM) have no ModelConfig equivalent
            raise CheckpointError(f"{self.path}: per-layer values for {key!r} are not supported")
        return int(value)

    def real(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default) if default is not None else self.require(key)
        # GGUF stores float32: take the shortest decimal that rounds to it (1e-05, not 9.99999974e-06).
        return float(str(np.float32(value)))


_DECODABLE: dict[str, bool] = {}


def _check_type(tensor: Any, path: Path) -> None:
    """A CheckpointError unless gguf.quants can dequantize the tensor's type (tried once per type)."""
    kind = tensor.tensor_type.name
    if kind not in _DECODABLE:
        size, nbytes = gguf.GGML_QUANT_SIZES.get(tensor.tensor_type, (1, 4))
        try:
            dequantize(np.zeros((1, nbytes), np.uint8), tensor.tensor_type)
            _DECODABLE[kind] = True
        except NotImplementedError:
            _DECODABLE[kind] = False
    if not _DECODABLE[kind]:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} has unsupported type {kind}")


def _index(tensors: list[TensorInfo], path: Path) -> dict[str, StoredTensor]:
    """Each tensor's place in the file under its HF name; a stacked-experts tensor [num_experts, out, in]
    (GGUF ne: in, out, experts) as one entry per expert, model.layers.{i}.mlp.experts.{e}.{proj}.weight."""
    stored: dict[str, StoredTensor] = {}
    for tensor in tensors:
        hf_name = _hf_name(tensor.name)
        stacked = _stacked(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 (the row length) first
        if stacked is None and hf_name is None:
            if tensor.name == "rope_freqs.weight":
                raise CheckpointError(
                    f"{path}: tensor 'rope_freqs.weight' (Llama-3.1-style rope scaling) is not supported"
                )
            raise CheckpointError(f"{path}: unexpected tensor {tensor.name!r} for a Llama-family model")
        _check_type(tensor, path)
        kind, offset, nbytes = tensor.tensor_type.name, int(tensor.data_offset), int(tensor.n_bytes)
        if stacked is None:
            if hf_name.endswith(_SELECTION_BIAS):
                shape = (1, int(np.prod(shape)))
            stored[hf_name] = StoredTensor(offset, nbytes, kind, shape)
            continue
        if len(shape) != 3:
            raise CheckpointError(f"{path}: tensor {tensor.name!r} has shape {list(shape)}, "
                                  "expected [experts, out, in]")
        layer, proj = stacked
        each = nbytes // shape[0]
        for e in range(shape[0]):
            stored[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = StoredTensor(
                offset + e * each, each, kind, shape[1:])
    return stored


def _stacked(name: str) -> tuple[int, str] | None:
    """(layer, HF projection name) of a stacked-experts tensor's name, else None."""
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _STACKED_EXPERTS:
        return None
    return int(match.group(1)), _STACKED_EXPERTS[match.group(2)]


def _moe_config(meta: _Metadata, arch_name: str, weights: dict[str, tuple[int, ...]],
                num_layers: int) -> MoeConfig | None:
    """The routed experts of a qwen3moe or ernie4_5-moe file: every block with a router (ffn_gate_inp) is
    routed, the others dense. llama.cpp renormalises the top-k weights of qwen3moe unless
    {arch}.expert_weights_norm says not, and always those of ernie4_5-moe (as transformers does, dividing by
    at least moe_norm_min's default); ERNIE's shared experts ({arch}.expert_shared_count) and selection bias
    (exp_probs_b) where the file has them."""
    if f"{arch_name}.expert_count" not in meta:
        return None
    routed = tuple(i for i in range(num_layers) if f"model.layers.{i}.mlp.gate.weight" in weights)
    ernie = arch_name in _ERNIE
    return MoeConfig(num_experts=meta.integer(f"{arch_name}.expert_count"),
                     top_k=meta.integer(f"{arch_name}.expert_used_count"),
                     intermediate_size=meta.integer(f"{arch_name}.expert_feed_forward_length"),
                     layers=routed,
                     norm_topk_prob=ernie or bool(meta.get(f"{arch_name}.expert_weights_norm", True)),
                     norm_min=1e-12 if ernie else 0.0,
                     num_shared_experts=meta.integer(f"{arch_name}.expert_shared_count", 0),
                     selection_bias=any(f"model.layers.{i}.{_SELECTION_BIAS}" in weights for i in routed))


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"


def _build_config(
    meta: _Metadata, arch_name: str, weights: dict[str, tuple[int, ...]], tokens: list[str] | None
) -> ModelConfig:
    """weights: each tensor's HF shape."""
    path = meta.path
    hidden_size = meta.integer(f"{arch_name}.embedding_length")
    num_heads = meta.integer(f"{arch_name}.attention.head_count")
    head_dim = meta.integer(f"{arch_name}.attention.key_length", hidden_size // num_heads)
    if meta.integer(f"{arch_name}.attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{path}: different key and value head sizes are not supported")
    if meta.integer(f"{arch_name}.rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{path}: partial rotary embeddings (rope dimension != head_dim) not supported")
    scaling = meta.get(f"{arch_name}.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"{path}: rope scaling {scaling!r} is not supported")
    if "model.embed_tokens.weight" not in weights:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' (model.embed_tokens.weight) is missing")
    vocab_size = weights["model.embed_tokens.weight"][0]
    if tokens is not None and len(tokens) > vocab_size:
        raise CheckpointError(f"{path}: {len(tokens)} tokens but token_embd.weight has {vocab_size} rows")
    num_layers = meta.integer(f"{arch_name}.block_count")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch_name],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta.integer(f"{arch_name}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta.integer(f"{arch_name}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta.real(f"{arch_name}.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.real(f"{arch_name}.rope.freq_base", 10000.0),
        max_position_embeddings=meta.integer(f"{arch_name}.context_length"),
        tie_word_embeddings="lm_head.weight" not in weights,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        o_bias="model.layers.0.self_attn.o_proj.bias" in weights,
        mlp_bias=any(name.endswith("mlp.down_proj.bias") for name in weights),
        qk_norm=arch_name in ("qwen3", "qwen3moe"),
        rope_interleaved=arch_name in _ERNIE,
        eos_token_ids=_eos_token_ids(meta, tokens),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        moe=_moe_config(meta, arch_name, weights, num_layers),
    )


def _eos_token_ids(meta: _Metadata, tokens: list | None) -> tuple[int, ...]:
    """eos, llama.cpp's end-of-turn id, and any chat end-of-turn marker that the chat template writes."""
    ids = [meta.get(key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    template = meta.get("tokenizer.chat_template") or ""
    if tokens is not None:
        ids += [tokens.index(marker) for marker in _END_OF_TURN if marker in template and marker in tokens]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_rows, kv_rows = config.num_heads * dim, config.num_kv_heads * dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    layer = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config.qkv_bias:
        layer |= {
            "self_attn.q_proj.bias": (q_rows,),
            "self_attn.k_proj.bias": (kv_rows,),
            "self_attn.v_proj.bias": (kv_rows,),
        }
    if config.o_bias:
        layer["self_attn.o_proj.bias"] = (hidden,)
    if config.mlp_bias:
        layer |= {"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,),
                  "mlp.down_proj.bias": (hidden,)}
    if config.qk_norm:
        layer |= {"self_attn.q_norm.weight": (dim,), "self_attn.k_norm.weight": (dim,)}
    moe = config.moe
    dense = {k: v for k, v in layer.items() if not k.startswith("mlp.")}
    # a routed block: its router and experts (and shared experts) instead of the dense MLP
    if moe is not None:
        dense["mlp.gate.weight"] = (moe.num_experts, hidden)
        if moe.selection_bias:
            dense[_SELECTION_BIAS] = (1, moe.num_experts)
        if moe.num_shared_experts:
            shared = moe.num_shared_experts * moe.intermediate_size
            dense |= {"mlp.shared_experts.gate_proj.weight": (shared, hidden),
                      "mlp.shared_experts.up_proj.weight": (shared, hidden),
                      "mlp.shared_experts.down_proj.weight": (hidden, shared)}
        for e in range(moe.num_experts):
            dense |= {f"mlp.experts.{e}.{p}_proj.weight": s for p, s in (
                ("gate", (moe.intermediate_size, hidden)), ("up", (moe.intermediate_size, hidden)),
                ("down", (hidden, moe.intermediate_size)))}
    for i in range(config.num_layers):
        routed = moe is not None and i in moe.layers
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in (dense if routed else layer).items()}
    return shapes


def _gguf_name(hf_name: str) -> str:
    for gguf_name, name in _GLOBAL_TENSORS.items():
        if name == hf_name:
            return gguf_name
    _, _, i, rest = hf_name.split(".", 3)
    if rest.startswith("mlp.experts."):  # one expert's part of a stacked tensor
        proj = rest.rsplit(".", 2)[1]
        return f"blk.{i}." + next(key for key, value in _STACKED_EXPERTS.items() if value == proj)
    return f"blk.{i}." + next(key for key, value in _LAYER_TENSORS.items() if value == rest)


def _check_tensors(weights: dict[str, tuple[int, ...]], config: ModelConfig, path: Path) -> None:
    expected = _expected_shapes(config)
    for name, shape in expected.items():
        if name not in weights:
            raise CheckpointError(f"{path}: tensor {_gguf_name(name)!r} ({name}) is missing")
        if weights[name] != shape:
            raise CheckpointError(
                f"{path}: tensor {_gguf_name(name)!r} ({name}) has shape {list(weights[name])}, "
                f"expected {list(shape)} (HF [out, in] layout)"
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"{path}: unexpected tensor {_gguf_name(extra[0])!r} for this configuration")


def _build_tokenizer(meta: _Metadata, path: Path) -> TextTokenizer | None:
    """A `tokenizers` tokenizer equal to the model's own (no tokenizer metadata: None): byte-level BPE
    ("gpt2", as the HF tokenizer.json) or SentencePiece BPE ("llama", as llama.cpp tokenizes it)."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model not in ("gpt2", "llama"):
        raise CheckpointError(
            f"{path}: tokenizer model {model!r} is not supported (only 'gpt2', byte-level BPE, and 'llama', "
            "SentencePiece BPE); give 'input_ids' with a model whose tokenizer is supported"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or []
    tokenizer = (_byte_level_bpe(meta, tokens, path) if model == "gpt2"
                 else _sentencepiece_bpe(meta, tokens, types))
    # CONTROL tokens are HF's special added tokens (<|im_start|>: one id, skipped when decoding);
    # USER_DEFINED ones are plain added tokens, also matched whole before BPE.
    control = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    user_defined = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return TextTokenizer(
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None,
        eos_token=tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )


def _byte_level_bpe(meta: _Metadata, tokens: list[str], path: Path) -> Tokenizer:
    merges = []
    for merge in meta.require("tokenizer.ggml.merges"):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise CheckpointError(f"{path}: malformed BPE merge {merge!r} in tokenizer.ggml.merges")
        merges.append((pair[0], pair[1]))
    # As in HF's byte-level tokenizer.json files: no unk token and no byte fallback (bytes missing from the
    # alphabet are dropped, exactly as `tokenizers` does for the original tokenizer).
    tokenizer = Tokenizer(BPE({token: i for i, token in enumerate(tokens)}, merges))
    _set_pre_tokenizer(tokenizer, meta.get("tokenizer.ggml.pre"), path)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str], types: list[int]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 2, Mistral, ERNIE-4.5: pieces with scores, "\u2581" for spaces,
    <0xNN> byte pieces) as a `tokenizers` BPE: SentencePiece merges the adjacent pair whose merged piece
    scores highest, so the merges are every split of a normal piece into two pieces, ranked by the merged
    piece's score. Spaces become "\u2581"; with tokenizer.ggml.add_space_prefix (the default) one is put
    before the text and, as llama.cpp does, after each special token. Pieces not in the vocabulary fall back
    to their bytes' pieces."""
    scores = meta.require("tokenizer.ggml.scores")
    kinds = list(types) or [_NORMAL] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []  # (-score of the merged piece, its split in id order)
    for i, token in enumerate(tokens):
        if kinds[i] != _NORMAL:
            continue
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked += [(-float(scores[i]), pair) for pair in splits]
    ranked.sort(key=lambda entry: entry[0])  # stable: equal scores keep the vocabulary's order
    unk = meta.get("tokenizer.ggml.unknown_token_id", kinds.index(_UNKNOWN) if _UNKNOWN in kinds else None)
    tokenizer = Tokenizer(BPE(vocab, [pair for _, pair in ranked],
                              unk_token=None if unk is None else tokens[unk],
                              fuse_unk=True, byte_fallback=_BYTE in kinds))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    space = [normalizers.Replace(" ", "\u2581")]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581")] * prefix + space)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse()]
                                          + [decoders.Strip(" ", 1, 0)] * prefix)
    return tokenizer


def _set_pre_tokenizer(tokenizer: Tokenizer, pre: str | None, path: Path) -> None:
    # No `pre` key (older converters): SmolLM2's setup, the default model's.
    pre = "smollm" if pre is None else pre
    if pre in _GPT2_DIGITS_PRE:
        # HF SmolLM2 / StarCoder tokenizer.json: Sequence[Digits(individual_digits), ByteLevel(use_regex)].
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif pre in _GPT2_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif pre in _SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        if pre == "qwen2":
            tokenizer.normalizer = normalizers.NFC()
    else:
        raise CheckpointError(
            f"{path}: tokenizer pre-type {pre!r} is not supported; supported: {SUPPORTED_PRE}"
        )
