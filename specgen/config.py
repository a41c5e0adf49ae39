"""Frozen configuration dataclasses, one per concern; the single source of defaults and of every runtime
choice."""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgen.errors import ConfigError


class Method(str, enum.Enum):
    """Speculative method: one string per method (each has a proposer in specgen.engine.proposers)."""

    NONE = "none"
    NGRAM = "ngram"
    MTP = "mtp"
    DRAFT_MODEL = "draft_model"
    MEDUSA = "medusa"
    EAGLE = "eagle"
    HYDRA = "hydra"
    EAGLE3 = "eagle3"

    @classmethod
    def parse(cls, value: str | "Method") -> "Method":
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown method {value!r} (valid: {valid})") from None


def opt(default: Any = dataclasses.MISSING, help: str = "", factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its help text: the one description of a setting, shown by `specgen run --help`."""
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
              "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
              "tib": 1 << 40}


def parse_size(text: str, name: str) -> int:
    """'8GiB', '512 MB', '1.5g', '1048576' -> bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT ")
    unit = text.strip()[len(number):].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or not value > 0:
        raise ConfigError(f"{name} must be a size such as 8GiB or 512MiB, got {text!r}")
    return int(value * SIZE_UNITS[unit])


def _one_of(name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, valid))}, got {value!r}")


TOP_LOGPROBS_MAX = 20  # OpenAI's bound on top_logprobs


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping {id: bias} (OpenAI's, ids as strings),
    "ID:BIAS" strings (the flag) or pairs; bias in [-100, 100]."""
    items = bias.items() if isinstance(bias, dict) else bias
    pairs = {}
    for item in items:
        try:
            tok, value = item.split(":") if isinstance(item, str) else item
            tok, value = int(tok), float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"logit_bias entries are token id and bias (ID:BIAS), got {item!r}") from None
        if tok < 0 or not -100 <= value <= 100:
            raise ConfigError(f"logit_bias: a token id >= 0 with a bias in [-100, 100], got {tok}: {value}")
        pairs[tok] = value
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_tokens: int = opt(256, "Output tokens per request (records may override).")
    temperature: float = opt(0.0, "Sampling temperature; 0 is greedy.")
    top_p: float = opt(1.0, "Nucleus sampling mass, (0, 1].")
    top_k: int = opt(0, "Top-k filter; 0 disables it.")
    min_p: float = opt(0.0, "Min-p filter, [0, 1]: keep tokens at least this share as likely as the most "
                            "likely one (vLLM's min_p); 0 disables it.")
    seed: int = opt(0, "Sampling seed (each request's randomness: seed, request id, output position).")
    stop: tuple[str, ...] = opt((), "Stop string (repeat the option for several); the text is cut before it.")
    ignore_eos: bool = opt(False, "Generate past EOS (fixed-length outputs).")
    logprobs: bool = opt(False, "Write each output token's log-probability (the model's raw log-softmax, the "
                                "distribution plain decoding samples from before temperature and filters).")
    top_logprobs: int = opt(0, "With --logprobs: also this many most likely tokens at each output position "
                               f"(at most {TOP_LOGPROBS_MAX}), with their log-probabilities.")
    logprobs_mode: str = opt("raw", "With --logprobs: raw (the model's log-softmax, vLLM's default) or "
                                    "processed (of the distribution the token was sampled from: after "
                                    "penalties, logit bias, the grammar's mask, temperature, top-k, top-p "
                                    "and min-p; tokens filtered out are not listed).")
    prompt_logprobs: int | None = opt(None, "Also write each prompt token's log-probability given the tokens "
                                            "before it (vLLM's prompt_logprobs; the raw log-softmax) with "
                                            f"this many most likely tokens (0 to {TOP_LOGPROBS_MAX}).")
    repetition_penalty: float = opt(1.0, "Divide the positive logits (multiply the negative ones) of tokens "
                                         "in the prompt or the output so far by this (transformers' and "
                                         "vLLM's); 1 is off.")
    presence_penalty: float = opt(0.0, "Subtract this from the logits of tokens the output holds (OpenAI's; "
                                       "-2 to 2).")
    frequency_penalty: float = opt(0.0, "Subtract this times its count in the output from each token's logit "
                                        "(OpenAI's; -2 to 2).")
    logit_bias: tuple[Any, ...] = opt((), "ID:BIAS added to a token's logit (repeat the option; OpenAI's "
                                          "logit_bias, -100 to 100).")
    min_tokens: int = opt(0, "No EOS (nor stop token id) before this many output tokens (vLLM's min_tokens).")
    stop_token_ids: tuple[Any, ...] = opt((), "A token id that ends the output as EOS does, kept in it "
                                              "(repeat the option for several; vLLM's stop_token_ids).")
    n: int = opt(1, "Samples per prompt (at most the batch size): one record each, with sample_index; they "
                    "share the prompt's prefill where the method allows it.")
    response_format: str = opt("", "Structured output for records without their own: OpenAI's "
                                   "response_format ({\"type\": \"json_schema\", \"json_schema\": "
                                   "{\"schema\": ...}} or {\"type\": \"json_object\"}), a bare JSON schema, "
                                   "or {\"type\": \"regex\" | \"choice\" | \"grammar\", ...}; inline JSON or "
                                   "a file.")

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= TOP_LOGPROBS_MAX:
            raise ConfigError(f"top_logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ConfigError("top_logprobs needs logprobs (set logprobs to true)")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ConfigError(f"logprobs_mode must be raw or processed, got {self.logprobs_mode!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= TOP_LOGPROBS_MAX:
            raise ConfigError(f"prompt_logprobs must be in [0, {TOP_LOGPROBS_MAX}], "
                              f"got {self.prompt_logprobs}")
        if not 0 < self.repetition_penalty <= 100:
            raise ConfigError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        try:
            stops = tuple(int(t) for t in self.stop_token_ids)
        except (TypeError, ValueError):
            raise ConfigError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}") from None
        if any(t < 0 for t in stops):
            raise ConfigError(f"stop_token_ids must be >= 0, got {stops}")
        object.__setattr__(self, "stop_token_ids", stops)
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop must be a list of non-empty strings")
        object.__setattr__(self, "response_format", response_format(self.response_format))
        if self.response_format and self.ignore_eos:
            raise ConfigError("response_format with ignore_eos: a constrained output ends where its grammar "
                              "does, at EOS")


def json_object(name: str, value: str) -> tuple[dict[str, Any], str]:
    """A JSON object given inline, or in the file `value` names: (the object, where it was read)."""
    text, where = value, name
    if not value.lstrip().startswith("{"):
        try:
            text, where = Path(value).read_text(encoding="utf-8"), value
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{name}: neither a JSON object nor a readable file ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    return data, where


GUIDED_TEXT = ("regex", "grammar")  # constraint kinds given as one string (a regex; a Lark or GBNF grammar)


def response_format(value: Any) -> str:
    """A structured-output constraint in its one canonical form, compact JSON:
    {"type": "json_schema", "schema": {...}} | {"type": "json_object"} | {"type": "regex", "regex": str} |
    {"type": "choice", "choice": [str, ...]} | {"type": "grammar", "grammar": str}; "" for none. Takes
    OpenAI's response_format object ({"type": "text"} is none), a bare JSON schema, the canonical form, or a
    string holding any of them as JSON or naming a file that does. Whether a schema, regex or grammar compiles
    is engine/grammar.py's to say (it needs the grammar engine)."""
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        value, _ = json_object("response_format", value)
    if not isinstance(value, dict):
        raise ConfigError(f"response_format must be a JSON object, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        spec: dict[str, Any] = {"type": "json_object"}
    elif kind == "json_schema":
        inner = value.get("json_schema", value)  # OpenAI's nests the schema; the canonical form does not
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise ConfigError('response_format of type json_schema needs "json_schema": {"schema": {...}} '
                              "(a schema object)")
        spec = {"type": "json_schema", "schema": schema}
    elif kind in GUIDED_TEXT:
        if not isinstance(value.get(kind), str) or not value[kind]:
            raise ConfigError(f'response_format of type {kind} needs "{kind}": a non-empty string')
        spec = {"type": kind, kind: value[kind]}
    elif kind == "choice":
        choice = value.get("choice")
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise ConfigError('response_format of type choice needs "choice": a list of non-empty strings')
        spec = {"type": "choice", "choice": choice}
    else:  # a bare JSON schema
        spec = {"type": "json_schema", "schema": value}
    # the schema's own key order kept: llguidance writes an object's properties in the order its schema lists
    # them (OpenAI's structured outputs do too)
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


DEVICES = ("auto", "cpu", "gpu")
# fused: specgen's CPU kernels (specgen/kernels), the whole forward as one operator; reference: Paddle's own
# operators, on any device Paddle runs on; auto: fused on a CPU where the kernels build and pay, else
# reference.
BACKENDS = ("auto", "fused", "reference")


@dataclass(frozen=True)
class EngineConfig:
    """The model's runtime (device, backend, precision, threads) and the static batch."""

    batch_size: int = opt(32, "Static batch slots, 1..256.")
    dtype: str = opt("float32", "float32 | float64 (exactness checks; ~1.5-2x slower).")
    threads: int = opt(0, "CPU threads; 0 uses every core available to the process.")
    device: str = opt("auto", "auto | cpu | gpu. auto: the GPU when Paddle is built with CUDA and one is "
                              "visible.")
    backend: str = opt("auto", "auto | fused | reference. fused: specgen's CPU kernels (the whole forward as "
                               "one operator); reference: Paddle's operators, any device; auto: fused where "
                               "the kernels build and pay (AVX2 or AVX-512).")
    cpu_target: str = opt("native", "The fused kernels' build target (-march): native, or e.g. x86-64-v3 for "
                                    "an AVX2 machine.")
    cache_dir: str = opt("", "Where converted models, kernel builds and step-cost tables are kept "
                             "[default: $XDG_CACHE_HOME/specgen or ~/.cache/specgen].")
    cost_cache: bool = opt(True, "Keep measured step-cost tables in the cache for a week (a rerun times "
                                 "nothing).")
    max_model_len: int = opt(0, "Cap on the context length; 0 keeps the model's.")
    max_kv_memory: str = opt("", "Cap on the KV cache's memory (e.g. 8GiB, 512MiB); a request that would "
                                 "take the cache past it (or past 90% of the memory available at start) "
                                 "stops the run with advice, instead of the kernel killing it. Empty: the "
                                 "memory available.")
    forced_drafts: bool = opt(True, "Where a response_format's grammar allows one continuation only, draft "
                                    "it (no drafter call; verified as any draft), ahead of the method's "
                                    "drafts.")
    max_prefill_tokens: int = opt(4096, "Prompt tokens admitted (and prefilled) per step.")
    prefill_chunk: int = opt(0, "Prefill prompts longer than this many tokens in chunks, mixed into decode "
                                "steps (0: whole prompts).")
    shared_prefix: str = opt("auto", "auto: compute the prompt prefix the first batch shares once, for every "
                                     "slot; off.")
    min_shared_prefix: int = opt(64, "Shorter common prefixes are not shared.")
    kv_cache_dtype: str = opt("auto", "auto: the KV cache in the compute dtype; float16: half its memory and "
                                      "reads (float32 models on the fused backend).")
    quantization: str = opt("auto", "auto | none | wint8 | wint4: the projections' and LM head's weights. "
                                     "auto: as stored (GGUF blocks, or float); none: float (GGUF blocks "
                                     "dequantized); wint8 / wint4: quantized at load in blocks of 32 inputs "
                                     "(Q8_0 / Q4_1), cached.")
    matmul: str = opt("float32", "float32 | int8. int8: inputs quantized to int8 per block of 32 for integer "
                                 "products with block weights (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K, --quantization "
                                 "wint8 / wint4; AVX-512 VNNI), as llama.cpp does.")

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= 256:
            raise ConfigError(f"batch_size must be in 1..256, got {self.batch_size}")
        _one_of("dtype", self.dtype, ("float32", "float64"))
        _one_of("device", self.device, DEVICES)
        _one_of("backend", self.backend, BACKENDS)
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if not self.cpu_target or any(c.isspace() for c in self.cpu_target):
            raise ConfigError(f"cpu_target must be a compiler -march value, got {self.cpu_target!r}")
        if self.max_model_len < 0 or self.max_prefill_tokens < 1:
            raise ConfigError("max_model_len must be >= 0 and max_prefill_tokens >= 1")
        self.kv_memory_limit()  # a bad size: an error now
        _one_of("shared_prefix", self.shared_prefix, ("auto", "off"))
        if self.min_shared_prefix < 1:
            raise ConfigError(f"min_shared_prefix must be >= 1, got {self.min_shared_prefix}")
        _one_of("kv_cache_dtype", self.kv_cache_dtype, ("auto", "float16"))
        if self.kv_cache_dtype == "float16" and self.dtype != "float32":
            raise ConfigError(f"kv_cache_dtype float16 needs dtype float32, got {self.dtype!r}")
        _one_of("quantization", self.quantization, ("auto", "none", "wint8", "wint4"))
        _one_of("matmul", self.matmul, ("float32", "int8"))
        if self.matmul == "int8" and self.dtype != "float32":
            raise ConfigError(f"matmul int8 needs dtype float32, got {self.dtype!r}")
        if self.prefill_chunk < 0:
            raise ConfigError(f"prefill_chunk must be >= 0 (0: no chunking), got {self.prefill_chunk}")

    def kv_memory_limit(self) -> int | None:
        """max_kv_memory in bytes (None: not set)."""
        return parse_size(self.max_kv_memory, "max_kv_memory") if self.max_kv_memory else None

    def cache_root(self) -> Path:
        """Where converted models, kernel builds and step-cost tables are kept."""
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specgen"

    def num_threads(self) -> int:
        return self.threads or default_threads()


@dataclass(frozen=True)
class NgramConfig:
    """--method ngram: drafts copied from where the text's tail occurred before (its own text, the job's
    pool)."""

    min: int = opt(1, "Shortest tail looked up, in tokens.")
    max: int = opt(3, "Longest tail looked up (a longer match wins).")
    pool: int = opt(1 << 20, "Tokens of finished requests' text searched for drafts too (0: each request's "
                             "own text only).")
    branches: int = opt(1, "Distinct continuations drafted at once as a token tree, verified in one forward "
                           "(1: a chain; a tree drafts from the slot's own text only).")
    tree_choices: tuple[str, ...] = opt((), "A static tree shape (Medusa's choices): the paths kept, each "
                                            "the ranks of its nodes among their siblings, "
                                            "comma-joined (0 0,0 1 0,1); repeat the option per path. "
                                            "Empty: every branch.")

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ConfigError(f"ngram needs 1 <= min <= max, got {self.min}, {self.max}")
        if self.pool < 0:
            raise ConfigError(f"ngram pool must be >= 0 tokens (0: no pool), got {self.pool}")
        if not 1 <= self.branches <= 8:
            raise ConfigError(f"ngram branches must be in [1, 8] (1: a chain), got {self.branches}")
        tree_paths(self.tree_choices, self.branches, "ngram tree_choices", "branches")

    def tree_paths(self) -> tuple[tuple[int, ...], ...]:
        """tree_choices as paths of ints."""
        return tree_paths(self.tree_choices, self.branches, "ngram tree_choices", "branches")


def tree_paths(choices: tuple[str, ...], max_rank: int, what: str, bound: str) -> tuple[tuple[int, ...], ...]:
    """A static tree shape's paths (each comma-joined sibling ranks, at most 5, each below max_rank) as
    ints."""
    out = []
    for path in choices:
        ranks = str(path).split(",")
        if not all(r.strip().isdigit() and int(r) < max_rank for r in ranks) or len(ranks) > 5:
            raise ConfigError(f"{what}: {path!r} is not a path of at most 5 comma-joined sibling ranks, each "
                              f"below {bound} ({max_rank}), e.g. 0,1")
        out.append(tuple(int(r) for r in ranks))
    return tuple(out)


@dataclass(frozen=True)
class MedusaConfig:
    """--method medusa and hydra: Medusa or Hydra heads (--draft-model: the public layout; the package's heads
    for the default model) draft a token tree of a static shape."""

    topk: int = opt(3, "Guesses kept per head: the most siblings a node can have.")
    tree_choices: tuple[str, ...] = opt(("0", "1", "2", "0,0", "0,1", "1,0", "0,0,0", "0,0,1", "0,1,0",
                                         "1,0,0", "0,0,0,0", "0,0,0,0,0"),
                                        "The tree's paths (Medusa's choices): each the ranks of its nodes' "
                                        "guesses at heads 1, 2, ..., comma-joined; "
                                        "repeat the option per path.")

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= 16:
            raise ConfigError(f"medusa topk must be in [1, 16], got {self.topk}")
        tree_paths(self.tree_choices, self.topk, "medusa tree_choices", "topk")

    def tree_paths(self) -> tuple[tuple[int, ...], ...]:
        return tree_paths(self.tree_choices, self.topk, "medusa tree_choices", "topk")


@dataclass(frozen=True)
class EagleConfig:
    """--method eagle: an EAGLE layer (--draft-model: the public layout; one ships for the default model)
    grows a token tree per slot, dynamic (EAGLE-2) or of a static shape."""

    topk: int = opt(4, "Children drafted per expanded node; a dynamic tree expands this many nodes per "
                       "depth.")
    nodes: int = opt(16, "Nodes offered per tree (the most probable ones; the controller verifies a prefix), "
                         "at most 64.")
    tree_choices: tuple[str, ...] = opt((), "A static tree shape instead of a dynamic one: its paths "
                                            "(Medusa's choices), each the ranks of its nodes among their "
                                            "siblings, comma-joined; repeat the option per path. Empty: "
                                            "EAGLE-2's dynamic tree.")
    quantize: bool = opt(True, "Beside a main model kept in GGUF blocks, pack the layer's projections as "
                               "Q8_0 blocks (as --mtp-quantize).")
    # As MtpConfig.copy: the layer trains on 128-position windows and hardly copies from far back.
    copy: int = opt(2, "Where the last N+ tokens occurred earlier in the slot's text, draft what followed "
                       "there (a chain) instead of the layer's tree (0: the layer only).")

    def __post_init__(self) -> None:
        if not 0 <= self.copy <= 8:
            raise ConfigError(f"eagle copy must be in 0..8 tokens (0: the layer's trees only), "
                              f"got {self.copy}")
        if not 1 <= self.topk <= 10:
            raise ConfigError(f"eagle topk must be in [1, 10], got {self.topk}")
        if not 1 <= self.nodes <= 64:
            raise ConfigError(f"eagle nodes must be in [1, 64], got {self.nodes}")
        tree_paths(self.tree_choices, self.topk, "eagle tree_choices", "topk")

    def tree_paths(self) -> tuple[tuple[int, ...], ...]:
        return tree_paths(self.tree_choices, self.topk, "eagle tree_choices", "topk")


@dataclass(frozen=True)
class MtpConfig:
    """--method mtp: a DeepSeek-V3 / ERNIE-4.5 style MTP head drafts the tokens after next."""

    model: str | None = opt(None, "The MTP head's directory (DeepSeek-V3 or ERNIE-4.5 layout) [default: the "
                                  "head shipped for the default model].")
    # The shipped head hardly copies from far back (it trains on 128-position windows), where summarization
    # and RAG answers come from.
    copy: int = opt(2, "Where the last N+ tokens occurred earlier in the slot's text, draft what followed "
                       "there instead of the head's guess (0: the head only).")
    # Its pass then reads a quarter of the bytes. Only drafts can change, never outputs.
    quantize: bool = opt(True, "Beside a main model kept in GGUF blocks, pack the head's projections as Q8_0 "
                               "blocks (integer products with AVX-512 VNNI).")

    def __post_init__(self) -> None:
        if not 0 <= self.copy <= 8:
            raise ConfigError(f"mtp copy must be in 0..8 tokens (0: the head's drafts only), got {self.copy}")


@dataclass(frozen=True)
class DraftConfig:
    """--method draft_model: a smaller model with the main model's vocabulary drafts (--draft-model)."""

    # A long prompt's catch-up would cost the draft a prefill of its own per request whether or not its drafts
    # pay (summarization at batch 1: 0.79x of plain decoding with the whole prompt).
    prompt_window: int = opt(256, "Prompt positions the draft reads: a prompt's last N (the draft's own "
                                  "positions start there); 0: the whole prompt.")

    def __post_init__(self) -> None:
        if self.prompt_window < 0:
            raise ConfigError(f"draft prompt_window must be >= 0, got {self.prompt_window}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: the method, its bound on drafts per step (FastDeploy's 1..5) and each method's
    own section."""

    method: Method = opt(Method.NONE, "Speculative method: none | ngram | mtp | draft_model | medusa | "
                                        "hydra | eagle.")
    num_speculative_tokens: int = opt(3, "Draft tokens per step at most, 1..5.")
    adaptive: bool = opt(True, "Choose each slot's drafts per step (0 included) from measured step costs and "
                               "acceptance; off: verify every draft offered.")
    draft_model: str | None = opt(None, "The drafter's checkpoint: for draft_model a smaller model with the "
                                        "main model's vocabulary (HF directory or .gguf; "
                                        "`specgen make-draft` builds one), for mtp an MTP head (as "
                                        "--mtp-model).")
    ngram: NgramConfig = opt(help="n-gram drafting.", factory=NgramConfig)
    mtp: MtpConfig = opt(help="MTP drafting.", factory=MtpConfig)
    draft: DraftConfig = opt(help="Draft-model drafting.", factory=DraftConfig)
    medusa: MedusaConfig = opt(help="Medusa and Hydra heads' token trees.", factory=MedusaConfig)
    eagle: EagleConfig = opt(help="EAGLE layers' token trees.", factory=EagleConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method.parse(self.method))
        if not 1 <= self.num_speculative_tokens <= 5:
            raise ConfigError(f"num_speculative_tokens must be in 1..5, got {self.num_speculative_tokens}")
        for name, cls in (("ngram", NgramConfig), ("mtp", MtpConfig), ("draft", DraftConfig),
                          ("medusa", MedusaConfig), ("eagle", EagleConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"speculative.{name} must be a {cls.__name__}")
        if self.method is Method.DRAFT_MODEL and not self.draft_model:
            raise ConfigError("--method draft_model needs --draft-model PATH (an HF directory or .gguf with "
                              "the main model's vocabulary; `specgen make-draft` builds one from the main "
                              "model)")


RAY_LOCAL = "local"  # ParallelConfig.ray: start a Ray instance on this machine


@dataclass(frozen=True)
class ParallelConfig:
    """How many engines run a job, and where: local worker processes, or a Ray cluster; and over how many
    ranks one engine's model is sharded."""

    data_parallel_size: int = opt(1, "Engines, each in its own worker process with its share of --threads, "
                                     "fed from one reader and writing through one writer (with --ray: Ray "
                                     "workers, each with --threads CPUs).")
    ray: str = opt("", "Run the job on Ray Data: a cluster's address (auto, host:port, ray://host:10001), or "
                       f"{RAY_LOCAL} to start an instance here (needs specgen[ray]). Empty: no Ray.")
    tensor_parallel_size: int = opt(1, "Ranks sharing one model's weights (attention heads, MLP columns, "
                                       "vocabulary), each a process with its share of --threads; rank 0 "
                                       "schedules and drafts. Dense models, reference backend.")
    pd: str = opt("", "Prefill/decode disaggregation, P:D (1:1 is 1P1D): P prefill workers compute each "
                      "prompt's KV cache, drafter state and first token and hand the request over shared "
                      "memory to one of D decode workers, which run the speculative decode loop; each worker "
                      "a process with its share of --threads. Empty: one engine does both.")
    expert_parallel_size: int = opt(1, "Ranks sharing a mixture-of-experts model: its experts split over "
                                       "them (whole experts per rank), attention, shared experts and "
                                       "vocabulary sharded as --tensor-parallel-size does; rank 0 schedules "
                                       "and drafts. Reference backend.")

    def __post_init__(self) -> None:
        if not 1 <= self.data_parallel_size <= 1024:
            raise ConfigError(f"data_parallel_size must be in 1..1024, got {self.data_parallel_size}")
        if self.ray != self.ray.strip() or any(c.isspace() for c in self.ray):
            raise ConfigError(f"ray must be a cluster address or {RAY_LOCAL!r}, got {self.ray!r}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ConfigError(f"tensor_parallel_size must be in 1..64, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and (self.data_parallel_size > 1 or self.ray):
            raise ConfigError("tensor_parallel_size > 1 does not combine with "
                              "data_parallel_size > 1 or ray yet")
        if self.pd:
            parse_pd(self.pd)
            if self.tensor_parallel_size > 1 or self.data_parallel_size > 1 or self.ray:
                raise ConfigError("pd does not combine with "
                                  "tensor_parallel_size, data_parallel_size or ray yet")
        if not 1 <= self.expert_parallel_size <= 64:
            raise ConfigError(f"expert_parallel_size must be in 1..64, got {self.expert_parallel_size}")
        if self.expert_parallel_size > 1 and (self.data_parallel_size > 1 or self.ray):
            raise ConfigError("expert_parallel_size > 1 does not combine with "
                              "data_parallel_size > 1 or ray yet")
        if self.expert_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ConfigError("expert_parallel_size shards attention over its own ranks (as tensor "
                              "parallelism does): give expert_parallel_size alone")

    @property
    def world_size(self) -> int:
        """Ranks of one sharded engine: --expert-parallel-size or --tensor-parallel-size (1: not sharded)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def pd_workers(self) -> tuple[int, int] | None:
        """(prefill, decode) workers of --pd, or None."""
        return parse_pd(self.pd) if self.pd else None


def parse_pd(text: str) -> tuple[int, int]:
    """'P:D' -> (P, D), prefill and decode workers, each 1..64."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"pd must be P:D, the prefill and decode workers (1:1, 2:1), got {text!r}")
    p, d = (int(x) for x in parts)
    if not (1 <= p <= 64 and 1 <= d <= 64):
        raise ConfigError(f"pd: 1..64 prefill and decode workers each, got {text!r}")
    return p, d


@dataclass(frozen=True)
class Drafter:
    """A method as the rest of specgen knows it (DRAFTERS): adding a drafter is its entry there, its proposer
    and, for a learned one, its module in specgen/drafters (docs/design.md, "Adding a drafter")."""

    factory: str  # "module:function" making its proposer from a Drafting (engine/proposers/base.py),
    # imported when a job builds one
    section: str | None = None  # its own SpecConfig section (the settings only it reads), if any
    checkpoint: bool = False  # drafts with a checkpoint (SpecConfig.draft_model)
    on_main: bool = False  # reads the main model's weights (a tensor-parallel job runs it on rank 0 beside a
    # full copy)


_P = "specgen.engine.proposers."
DRAFTERS: dict[Method, Drafter] = {
    Method.NONE: Drafter(_P + "base:build_none"),
    Method.NGRAM: Drafter(_P + "ngram:build_ngram_proposer", "ngram"),
    Method.MTP: Drafter(_P + "mtp:build_mtp_proposer", "mtp", checkpoint=True, on_main=True),
    Method.DRAFT_MODEL: Drafter(_P + "draft_model:build_draft_model_proposer", "draft", checkpoint=True),
    Method.MEDUSA: Drafter(_P + "medusa:build_medusa_proposer", "medusa", checkpoint=True, on_main=True),
    Method.HYDRA: Drafter(_P + "hydra:build_hydra_proposer", "medusa", checkpoint=True, on_main=True),
    Method.EAGLE: Drafter(_P + "eagle:build_eagle_proposer", "eagle", checkpoint=True, on_main=True),
    Method.EAGLE3: Drafter(_P + "eagle:build_eagle3_proposer", "eagle", checkpoint=True, on_main=True),
}
assert set(DRAFTERS) == set(Method), "every method needs its DRAFTERS entry"


def _nested_type(cls: type, name: str) -> type | None:
    """The config dataclass a field of `cls` holds, if it holds one (SpecConfig.ngram -> NgramConfig)."""
    hint = typing.get_type_hints(cls).get(name)
    return hint if dataclasses.is_dataclass(hint) else None


def from_mapping(cls: type, values: dict[str, Any], where: str) -> Any:
    """Build a config dataclass from a mapping, nested sections from nested mappings; unknown keys are an
    error naming the valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(values) - names))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(sorted(names))})")
    built = dict(values)
    for name, value in values.items():
        sub = _nested_type(cls, name)
        if sub is not None:
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}.{name} must be a mapping of field: value")
            built[name] = from_mapping(sub, value, f"{where}.{name}")
    try:
        return cls(**built)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class RunConfig:
    """The resolved configs of a run; each component receives only its own part."""

    sampling: SamplingParams
    engine: EngineConfig
    spec: SpecConfig
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)


__all__ = ["Method", "SamplingParams", "EngineConfig", "SpecConfig", "NgramConfig", "MtpConfig",
           "MedusaConfig", "EagleConfig", "ParallelConfig", "RunConfig", "DRAFTERS", "Drafter",
           "from_mapping", "default_threads", "opt", "DEVICES", "BACKENDS"]
