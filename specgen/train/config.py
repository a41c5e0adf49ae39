"""Settings of `specgen train-head` (and its alias `train-mtp`): one frozen dataclass, the single source of
defaults."""
from __future__ import annotations

from dataclasses import dataclass

from specgen.errors import ConfigError

SAVE_DTYPES = ("float16", "float32")
INITS = ("last-layer", "random")
WINDOW_ANCHORS = ("start", "end")


@dataclass(frozen=True)
class TrainConfig:
    """Data generation, the head's optimisation and what is written where."""

    # data: the main model's own greedy continuations of the prompts
    gen_max_tokens: int = 256  # tokens generated per prompt (fewer when the model stops)
    gen_batch_size: int = 64  # engine slots while generating
    gen_samples: int = 1  # continuations per prompt: the greedy one, and gen_samples - 1 sampled ones (more
    # text in the model's own style from the same prompts; labels stay the model's greedy choices, recorded
    # per position)
    gen_temperature: float = 0.8  # temperature of the sampled continuations
    prompt_examples: bool = True  # prompt positions are training examples too (labels: the model's greedy
    # choices)
    context_tokens: int = 32  # without prompt examples: prompt positions kept as context before the
    # continuation
    eval_fraction: float = 0.05  # share of the sequences held out for evaluation
    max_eval_windows: int = 32  # windows of the held-out sequences evaluated (full vocabulary)
    # optimisation
    steps: int = 500  # labels only, the default head's held-out accuracy peaked by step 500;
    # with --distill 0.5: 0.433 at 500 and 0.438 at 800 (the shipped head: --steps 800, ~27 min of training)
    batch_size: int = 16  # windows per step
    seq_len: int = 128  # positions per window
    window_anchor: str = "start"  # windows tiled from each sequence's start, or back from its end
    # (windows.py)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    shortlist: int = 8192  # training softmax over the most frequent labels; 0: the full vocabulary
    draft_vocab: int = 2048  # tokens in the saved draft vocabulary (draft_vocab.npy): the most frequent
    # training labels, so that each draft's LM head is that much cheaper; 0: the whole training vocabulary.
    # The default model's head drafts as well from its top 2,048 labels as from all 8,161 (acceptance within
    # 0.01 on four sets) and its pass takes ~0.3 ms less per step at batch 1 (BENCHMARKS.md)
    hidden_noise: float = 0.0  # Gaussian noise on the main hidden input, std relative to each row's RMS
    # (EAGLE)
    distill: float = 0.5  # weight of the soft-target loss: cross-entropy against the main model's own
    # distribution over the shortlist (from its cached hidden state one position on), the rest on the greedy
    # label; 0: labels only. On the default model's 400 prompts, 500 steps:
    # held-out top-1 0.415 (0) -> 0.433 (0.5), 0.420 (1)
    num_layers: int = 1  # MTP modules (DeepSeek-V3's num_nextn_predict_layers): module i trained on the
    # labels of position i + 1 from module i - 1's output; with one, the head is chained with itself for later
    # drafts
    module_weight: float = 0.5  # loss weight of modules 1.. relative to module 0 (with num_layers > 1)
    chain_weight: float = 0.5  # weight of the second-draft loss (the head applied to its own output);
    # 0 halves a step
    init: str = "last-layer"  # block initialised from the main model's last layer, or random
    # Medusa and Hydra heads (train-head --kind medusa | hydra; the other kinds ignore these)
    heads: int = 4  # heads: head i drafts the token i + 1 places after the next one
    head_layers: int = 1  # residual blocks per head (Medusa's medusa_num_layers, Hydra's hydra_num_layers)
    head_decay: float = 0.8  # loss weight of head i is head_decay ** i (Medusa's lambda_k = 0.8^k)
    seed: int = 0
    # bookkeeping
    log_every: int = 10
    eval_every: int = 100
    checkpoint_every: int = 100
    save_dtype: str = "float16"  # dtype of the saved head (loading upcasts)

    def __post_init__(self) -> None:
        positive = ("gen_max_tokens", "gen_batch_size", "gen_samples", "steps", "batch_size", "log_every",
                    "eval_every", "checkpoint_every", "max_eval_windows")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.gen_batch_size <= 256:
            raise ConfigError(f"gen-batch-size must be in 1..256, got {self.gen_batch_size}")
        if self.seq_len < 4:
            raise ConfigError(f"seq-len must be >= 4, got {self.seq_len}")
        if self.context_tokens < 0 or self.warmup_steps < 0 or self.shortlist < 0 or self.draft_vocab < 0:
            raise ConfigError("context-tokens, warmup-steps, shortlist and draft-vocab must be >= 0")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ConfigError("need lr > 0, 0 <= min-lr-ratio <= 1, weight-decay >= 0, grad-clip > 0")
        if self.gen_temperature <= 0:
            raise ConfigError(f"gen-temperature must be > 0, got {self.gen_temperature}")
        if self.chain_weight < 0 or self.hidden_noise < 0 or self.module_weight < 0:
            raise ConfigError("chain-weight, module-weight and hidden-noise must be >= 0")
        if not 1 <= self.heads <= 5:
            raise ConfigError(f"heads must be in 1..5 (the deepest draft), got {self.heads}")
        if not 1 <= self.head_layers <= 4:
            raise ConfigError(f"head-layers must be in 1..4, got {self.head_layers}")
        if not 0 < self.head_decay <= 1:
            raise ConfigError(f"head-decay must be in (0, 1], got {self.head_decay}")
        if not 1 <= self.num_layers <= 8:
            raise ConfigError(f"num-layers must be in 1..8, got {self.num_layers}")
        if not 0 <= self.distill <= 1:
            raise ConfigError(f"distill must be in [0, 1], got {self.distill}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ConfigError(f"save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}")
        if self.window_anchor not in WINDOW_ANCHORS:
            raise ConfigError(f"window-anchor must be one of {', '.join(WINDOW_ANCHORS)}, "
                              f"got {self.window_anchor!r}")
        if self.init not in INITS:
            raise ConfigError(f"init must be one of {', '.join(INITS)}, got {self.init!r}")

    @property
    def overlap(self) -> int:
        """Positions a window repeats from the one before it, as attention context (no loss on them)."""
        return min(self.context_tokens, self.seq_len // 4)
