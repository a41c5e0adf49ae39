"""--tensor-parallel-size N: one model's weights sharded over N rank processes
(specgen/distributed/tp_shard.py), summed with paddle.distributed collectives (gloo on the CPU, NCCL on GPUs).

Rank 0 is the engine: it schedules, drafts (n-gram; the MTP head and draft model run there beside the full
model, replicated rather than sharded), samples, verifies and sends each output to the parent, which writes
it. Every forward it runs is first sent to the other ranks (a Command: the packed batch and which cache),
which run their shard of it; the all-reduces inside the blocks then meet. Only rank 0 chooses tokens, from
logits gathered over the vocabulary shards, so no rank can disagree about a token: the next forward's batch
carries it.

--expert-parallel-size N runs the same ranks over a mixture-of-experts model, its experts split over them
(tp_shard.py): attention stays sharded by heads, as here, rather than replicated with the batch split over the
ranks (DP attention). One engine keeps one scheduler and one drafter, every rank sees every token of every
forward (so all route alike, and no rank ever runs an empty forward to meet another's collective), and the KV
cache is split by heads; the price is the attention's all-reduce per block, which DP attention would not
pay."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.backends.base import ForwardOutput, ModelView
from specgen.backends.reference import ReferenceBackend
from specgen.config import DRAFTERS, EngineConfig, SpecConfig
from specgen.distributed.data_parallel import WorkerEngine, worker_engines
from specgen.distributed.launch import Worker, WorkerGroup
from specgen.distributed.tp_shard import RankShard, check_tensor_parallel, plan_shard, shard_weights
from specgen.errors import CheckpointError, ConfigError
from specgen.models.config import ModelConfig
from specgen.runtime.batch import ForwardBatch
from specgen.runtime.kv_cache import KVCache, available_memory

NEW_CACHE, FORWARD, LOGITS, CACHE_CALL, STOP = "new_cache", "forward", "logits", "cache_call", "stop"
DEATH_GRACE_SECONDS = 3.0  # after a rank's error, how long to look for a dead peer that caused it


class Command(NamedTuple):
    """What rank 0 tells the other ranks to run (sent before it runs it itself)."""

    kind: str  # NEW_CACHE | FORWARD | LOGITS | CACHE_CALL | STOP
    cache: int  # the cache's id (-1: none)
    payload: Any  # NEW_CACHE (num_slots, max_capacity, kv_dtype, num_layers); FORWARD (ForwardBatch, logits,
    # the shared prefix's cache id or -1); LOGITS hidden rows ndarray [rows, hidden]; CACHE_CALL (a ShardCache
    # method's name, its arguments)
    freed: tuple[int, ...]  # caches rank 0 has dropped since its last command


class CommandChannel:
    """Rank 0's Commands to the other ranks, over one multiprocessing queue per rank (not a paddle.distributed
    broadcast: a rank waiting for its next command waits as long as rank 0 takes, loading a drafter or waiting
    for input, and gloo ends a collective that waited 30 s)."""

    def __init__(self, queues: tuple[Any, ...], rank: int):
        self.queues, self.rank = queues, rank  # queues[r]: rank r's (queues[0] is None)

    @classmethod
    def make(cls, world_size: int) -> tuple[Any, ...]:
        """The queues for a group of world_size ranks (passed to each rank in its RankJob)."""
        ctx = mp.get_context("spawn")
        return (None, *(ctx.Queue() for _ in range(world_size - 1)))

    def send(self, cmd: Command) -> None:
        for q in self.queues[1:]:
            q.put(cmd)

    def receive(self) -> Command:
        return self.queues[self.rank].get()


class ShardCache(KVCache):
    """A rank's KV cache of its KV heads, known to every rank by one id. What the engine does to rank 0's
    cache besides a forward (clear a slot, move a token tree's accepted rows, copy a prompt's rows to another
    sample's slot) it tells the others to do to theirs."""

    def __init__(self, cache_id: int, mirror, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # mirror(cache_id, method name, args): rank 0's; else None
        self.cache_id, self.mirror = cache_id, mirror

    def clear_slot(self, slot: int) -> None:
        if self.mirror is not None:
            self.mirror(self.cache_id, "clear_slot", (slot,))
        super().clear_slot(slot)

    def move_rows(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        if self.mirror is not None:
            self.mirror(self.cache_id, "move_rows", (slots, src, dst))
        super().move_rows(slots, src, dst)

    def copy_slot(self, src: int, dst: int, n: int, prefix_len: int = 0) -> None:
        if self.mirror is not None:
            self.mirror(self.cache_id, "copy_slot", (src, dst, n, prefix_len))
        super().copy_slot(src, dst, n, prefix_len)


@dataclass
class Traffic:
    """A rank's collectives of one kind (the benchmark reads them): how many, the bytes it sent into them (its
    tensor's), and the seconds in them (waiting for the other ranks included)."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0


class TensorParallelBackend(ReferenceBackend):
    """One rank's part of every forward: the reference backend's forward over its shard, its hooks summing
    over the ranks after the embedding and each block's o and down products, and gathering the logits over the
    vocabulary. Rank 0's calls send themselves to the other ranks first (Command); theirs come from
    `follow`."""

    name = "tensor-parallel"
    keeps_blocks = False  # its shards are cut from float weights (tp_shard.py)

    def __init__(self, engine: EngineConfig, rank: int, world_size: int, channel: CommandChannel):
        super().__init__(engine)
        self.rank, self.world_size, self.channel = rank, world_size, channel
        self.shard: RankShard | None = None  # set by prepare
        self.num_caches = 0
        self.freed: list[int] = []
        # kind ("embedding", "attention", "mlp": a block's sums; "vocab": the logits' gathers)
        # -> its collectives
        self.traffic: dict[str, Traffic] = {}

    # ---- the collectives ----

    def _send(self, kind: str, cache: int, payload: Any) -> None:
        if self.rank == 0:
            freed, self.freed = tuple(self.freed), []
            self.channel.send(Command(kind, cache, payload, freed))

    @property
    def comm_seconds(self) -> float:
        return sum(t.seconds for t in self.traffic.values())

    @property
    def num_collectives(self) -> int:
        return sum(t.count for t in self.traffic.values())

    def _count(self, kind: str, x: paddle.Tensor, start: float) -> None:
        t = self.traffic.setdefault(kind, Traffic())
        t.count, t.nbytes = t.count + 1, t.nbytes + x.size * x.element_size()
        t.seconds += time.perf_counter() - start

    def reduce(self, x: paddle.Tensor, kind: str = "embedding") -> paddle.Tensor:
        start = time.perf_counter()
        paddle.distributed.all_reduce(x)
        self._count(kind, x, start)
        return x

    def _all_gather(self, x: paddle.Tensor) -> list[paddle.Tensor]:
        start = time.perf_counter()
        parts: list[paddle.Tensor] = []
        paddle.distributed.all_gather(parts, x)
        self._count("vocab", x, start)
        return parts

    # ---- the Backend protocol ----

    def prepare(self, model: ModelView) -> None:
        """Replace the model's weights by this rank's shard, and its block shape by the local heads'."""
        for lin in model.weights.linears():
            if lin.weight is None:
                raise CheckpointError("tensor parallelism shards float weights (none was converted)")
        self.shard = plan_shard(model.config, self.rank, self.world_size)
        model.weights = shard_weights(model.weights, self.shard, model.shape, model.config.intermediate_size)
        model.shape = self.shard.shape(model.shape)

    def new_cache(self, model: ModelView, num_slots: int, max_capacity: int, kv_dtype: str = "auto",
                  num_layers: int | None = None, cache_id: int | None = None) -> ShardCache:
        if kv_dtype not in ("auto", self.dtype):
            raise ConfigError(f"a {kv_dtype} KV cache needs the fused backend, which tensor parallelism "
                              "does not use; leave --kv-cache-dtype auto")
        if cache_id is None:
            cache_id, self.num_caches = self.num_caches, self.num_caches + 1
            self._send(NEW_CACHE, cache_id, (num_slots, max_capacity, kv_dtype, num_layers))
        cfg = model.config
        cache = ShardCache(cache_id, self._mirror if self.rank == 0 else None,
                           cfg.num_layers if num_layers is None else num_layers, num_slots,
                           model.shape.num_kv_heads, cfg.head_dim, self.dtype, max_capacity, zeroed=True)
        if self.rank == 0:
            weakref.finalize(cache, self.freed.append, cache_id)
        return cache

    def _mirror(self, cache_id: int, method: str, args: tuple) -> None:
        self._send(CACHE_CALL, cache_id, (method, args))

    def forward(self, model: ModelView, batch: ForwardBatch, cache: ShardCache,
                logits: bool = True, features: tuple[int, ...] = (), sampling=None) -> ForwardOutput:
        """The reference forward over this rank's shard, every rank's hooks meeting in the same collectives;
        rank 0 first sends the forward to the others."""
        prefix = cache.prefix.cache_id if cache.prefix is not None else -1
        self._send(FORWARD, cache.cache_id, (batch, logits, prefix))
        return super().forward(model, batch, cache, logits, features)  # (capturing needs no collective)

    def head(self, model: ModelView, hidden: paddle.Tensor, rows: np.ndarray,
             logits: bool) -> tuple[paddle.Tensor | None, np.ndarray]:
        """The rank's vocabulary columns, gathered over the ranks; greedy rows alone gather only each rank's
        best."""
        if not len(rows):
            return paddle.zeros([0, model.config.vocab_size], self.dtype), np.zeros(0, np.int64)
        # [num_logits, local_vocab]
        local = model.weights.lm_head(paddle.gather(hidden, paddle.to_tensor(rows)))
        if logits:
            full = self._gather_vocab(local)  # [num_logits, vocab]
            return full, paddle.argmax(full, axis=-1).numpy()
        return None, self._argmax(local)

    def logits(self, model: ModelView, hidden: paddle.Tensor) -> paddle.Tensor:
        self._send(LOGITS, -1, hidden.numpy())
        return self._gather_vocab(model.weights.lm_head(hidden))

    def prepare_drafter(self, model: ModelView, weights: Any, quantize: bool) -> Any:
        raise ConfigError("a learned drafter runs on rank 0 beside the full model, not on a tensor-parallel "
                          "shard")

    def describe(self) -> list:
        return [self.name, self.world_size]

    # ---- vocabulary-parallel embedding and LM head ----

    def embed(self, token_ids: np.ndarray, embed: paddle.Tensor) -> paddle.Tensor:
        """Each rank looks up the tokens in its vocabulary range (zeros for the others'); the sum is every
        row, exactly (x + 0 = x)."""
        lo, hi = self.shard.vocab
        mine = (token_ids >= lo) & (token_ids < hi)  # [num_tokens]
        rows = F.embedding(paddle.to_tensor(np.where(mine, token_ids - lo, 0)), embed)  # [num_tokens, hidden]
        return self.reduce(rows * paddle.to_tensor(mine[:, None].astype(self.dtype)))

    def _gather_vocab(self, local: paddle.Tensor) -> paddle.Tensor:
        """[rows, local_vocab] on each rank -> [rows, vocab] (every rank's columns, in vocabulary order)."""
        sizes = self.shard.vocab_sizes
        pad = max(sizes) - local.shape[1]
        if pad:  # all_gather wants one shape: pad, then drop the padding
            local = paddle.concat([local, paddle.zeros([local.shape[0], pad], local.dtype)], axis=1)
        parts = self._all_gather(local)
        return paddle.concat([p[:, :n] for p, n in zip(parts, sizes)], axis=1)

    def _argmax(self, local: paddle.Tensor) -> np.ndarray:
        """The greedy token of each row without gathering the logits: each rank's best (value, id), gathered
        [ranks, rows, 2]; the highest value wins, the lowest rank (so the lowest id) on a tie, as argmax
        does."""
        lo, _ = self.shard.vocab
        best = paddle.stack([paddle.max(local, axis=-1).astype("float64"),
                             (paddle.argmax(local, axis=-1) + lo).astype("float64")], axis=-1)  # [rows, 2]
        return best_of_ranks(np.stack([p.numpy() for p in self._all_gather(best)]))

    def stop(self) -> None:
        """Rank 0: end the other ranks' `follow`."""
        self._send(STOP, -1, None)



def best_of_ranks(pairs: np.ndarray) -> np.ndarray:
    """pairs [ranks, rows, 2] float64: each rank's (best logit, its token id) per row (ids below 2^53: exact)
    -> [rows] int64 the row's token: the highest logit; on a tie the first rank's, whose vocabulary range
    comes first, so the lowest id, as argmax over the whole row gives."""
    winner = np.argmax(pairs[:, :, 0], axis=0)  # [rows] the first rank holding the row's maximum
    return pairs[winner, np.arange(pairs.shape[1]), 1].astype(np.int64)


def follow(model: Any, backend: TensorParallelBackend) -> dict[str, int]:
    """A rank other than 0: run each Command rank 0 sends until STOP; returns its KV caches' peak (as
    Engine.memory counts the engine's cache: id 0, the first made)."""
    caches: dict[int, ShardCache] = {}
    while (cmd := backend.channel.receive()).kind != STOP:
        for cache_id in cmd.freed:
            caches.pop(cache_id, None)
        if cmd.kind == NEW_CACHE:
            caches[cmd.cache] = backend.new_cache(model, *cmd.payload, cache_id=cmd.cache)
        elif cmd.kind == FORWARD:
            batch, logits, prefix = cmd.payload
            cache = caches[cmd.cache]
            cache.prefix = caches[prefix] if prefix >= 0 else None
            backend.forward(model, batch, cache, logits)
        elif cmd.kind == LOGITS:
            backend.logits(model, paddle.to_tensor(cmd.payload))
        elif cmd.kind == CACHE_CALL:
            method, args = cmd.payload
            getattr(caches[cmd.cache], method)(*args)
    return shard_memory(caches.get(0))


def shard_memory(c: ShardCache | None) -> dict[str, int]:
    """A rank's share of Engine.memory's KV bytes (the ranks' shares add up to the job's)."""
    if c is None:
        return {"kv_cache_bytes": 0, "kv_cache_bytes_unshared": 0}
    prefix = c.prefix.nbytes() if c.prefix is not None else 0
    return {"kv_cache_bytes": c.nbytes(c.peak_own) + prefix,
            "kv_cache_bytes_unshared": c.nbytes(c.peak_position)}


@dataclass(frozen=True)
class RankJob:
    """What every rank needs (sent once, pickled): the checkpoint, the settings, the group's address."""

    model: str  # the checkpoint's path (LoadedModel.source)
    load: EngineConfig  # the settings the parent loaded it with
    engine: EngineConfig  # the job's batch settings (rank 0's engine)
    spec: SpecConfig
    endpoints: tuple[str, ...]  # [world_size] host:port of each rank
    commands: tuple[Any, ...]  # [world_size] CommandChannel.make's queues


def join_group(rank: int, job: RankJob) -> str:
    """Make this process rank `rank` of paddle.distributed's default group; returns its device. The
    environment is paddle.distributed's own launcher protocol (what `python -m paddle.distributed.launch`
    would set), written here because specgen is the launcher; no specgen setting is read from it."""
    from specgen.backends import resolve_device

    device = resolve_device(job.load.device)
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(len(job.endpoints)),
                      PADDLE_TRAINER_ENDPOINTS=",".join(job.endpoints),
                      PADDLE_CURRENT_ENDPOINT=job.endpoints[rank],
                      PADDLE_DISTRI_BACKEND="nccl" if device == "gpu" else "gloo")
    if device == "gpu":
        os.environ["FLAGS_selected_gpus"] = str(rank)
        device = f"gpu:{rank}"
    paddle.set_device(device)
    with _quiet_stderr():
        paddle.distributed.init_parallel_env()
    return device


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Paddle's start-up chatter on file descriptor 2 (its modified FLAGS, the TCP store's connections) kept
    from the user's terminal; shown if the start-up fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def load_rank(job: RankJob, rank: int, world_size: int, threads: int) -> tuple[Any, Any, EngineConfig]:
    """This rank's shard of the model: (Model, its checkpoint, the load settings with this rank's threads)."""
    from specgen.models import load_checkpoint
    from specgen.models.model import Model

    load = dataclasses.replace(job.load, threads=threads)
    paddle.base.core.set_num_threads(load.num_threads())
    ckpt = load_checkpoint(job.model, load.cache_root(), load.quantization)
    backend = TensorParallelBackend(load, rank, world_size, CommandChannel(job.commands, rank))
    return Model(ckpt, backend), ckpt, load


def serve_rank(worker: Worker, job: RankJob) -> dict[str, int]:
    """A rank: rank 0 runs the engine over the requests it takes, sending each output as it finishes; the
    others follow it. Returns the rank's KV cache peak."""
    from specgen.api import LoadedModel, load_model, make_engine

    spec = worker.spec
    join_group(spec.rank, job)
    model, ckpt, load = load_rank(job, spec.rank, spec.world_size, spec.threads)
    if spec.rank:
        worker.ready()
        return follow(model, model.backend)
    loaded = LoadedModel(model, ckpt.tokenizer, ckpt.config, ckpt.source, load)
    # MTP, EAGLE, Medusa and Hydra heads read the main model's full embedding or LM head (a rank holds a slice
    # of the vocabulary): rank 0 keeps a full copy for them (replicated, run here only). n-gram needs no
    # model; a draft model loads its own checkpoint whole.
    drafting = load_model(job.model, load) if DRAFTERS[job.spec.method].on_main else loaded
    engine = make_engine(loaded, job.engine, job.spec, drafting=drafting)
    worker.ready()
    try:
        for out in engine.run(worker.tasks()):
            worker.send(out)
    finally:
        model.backend.stop()
    return engine.memory()


def free_endpoints(world_size: int) -> tuple[str, ...]:
    """A loopback address for each rank, with a port free now (the ranks bind them moments later)."""
    socks = [socket.socket() for _ in range(world_size)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return tuple(f"127.0.0.1:{s.getsockname()[1]}" for s in socks)
    finally:
        for s in socks:
            s.close()


def check_engine(engine: EngineConfig, world_size: int, flag: str = "--tensor-parallel-size") -> None:
    """The ranks run the reference backend's operators over float weights, on the CPU or one GPU each."""
    from specgen.backends import resolve_device

    if resolve_device(engine.device) == "gpu" and paddle.device.cuda.device_count() < world_size:
        raise ConfigError(f"{flag} {world_size} on GPUs needs one GPU per rank; "
                          f"{paddle.device.cuda.device_count()} are visible")
    if engine.backend == "fused":
        raise ConfigError(f"{flag} runs the reference backend (the fused CPU forward is one operator "
                          "over all layers, with no sum between them); use --backend auto or reference")
    if engine.matmul != "float32" or engine.quantization in ("wint8", "wint4"):
        raise ConfigError(f"{flag} shards float weights: leave --matmul float32 "
                          "and --quantization auto or none")
    if engine.kv_cache_dtype != "auto":
        raise ConfigError(f"{flag} keeps the KV cache in the model's dtype: leave --kv-cache-dtype auto")


def tensor_parallel_engine(model: str, load: EngineConfig, engine: EngineConfig, spec: SpecConfig,
                           world_size: int, config: ModelConfig,
                           expert_parallel: bool = False) -> WorkerEngine:
    """Engine.run's contract over `world_size` tensor-parallel ranks: requests go to rank 0 only (the others
    never take a task), outputs come back from it; the KV budget is rank 0's share of it (its KV heads over
    all ranks').
    expert_parallel: a mixture-of-experts model, its experts split over the ranks too
    (--expert-parallel-size).
    A rank's error that a dead peer caused (a collective broken under it) is reported as the death."""
    check_tensor_parallel(config, world_size, expert_parallel)
    kind = "expert" if expert_parallel else "tensor"
    check_engine(load, world_size, f"--{kind}-parallel-size")
    threads, _ = worker_engines(engine, world_size)
    kv = [len(plan_shard(config, r, world_size).kv_heads) for r in range(world_size)]
    budget = engine.kv_memory_limit() or int(0.9 * available_memory())
    rank0 = dataclasses.replace(engine, max_kv_memory=str(max(budget * kv[0] // sum(kv), 1)))
    job = RankJob(model, load, rank0, spec, free_endpoints(world_size), CommandChannel.make(world_size))
    group = WorkerGroup(serve_rank, job, threads, f"{kind}-parallel rank")
    return WorkerEngine(group, 2 * engine.batch_size, grace=DEATH_GRACE_SECONDS)
