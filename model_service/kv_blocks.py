"""Paged KV memory's host side: which pool blocks each slot's sequence owns, and the prefix cache.

The device pool (kv_memory.py) holds `num_blocks` blocks of `block_size` positions per layer, plus one
scratch block (index `num_blocks`) that every unused table entry points at, so writes meant for nothing
land there. A slot's block table maps its positions to pool blocks: position p lives in block
table[p // block_size] at offset p % block_size. Blocks are allocated as a sequence grows and given back
when it ends; a block may be referenced by several tables (the samples of one prompt, or requests sharing
a cached prefix) and is reused only when no table holds it.

Prefix cache (vLLM's automatic prefix caching, SGLang's radix reuse): a full block computed on the
prefill chunk grid (Engine.begin_prefill; chunks start at multiples of the chunk size, so a block's bits
depend only on the tokens up to its end) is keyed by a hash chain over its tokens and its prefix's key.
When its last holder ends it stays in the pool, evictable in least-recently-used order, and a later prompt
with the same leading tokens takes it instead of recomputing. Reuse ends on a chunk boundary and always
leaves at least one prompt token to compute (the first sampled token needs its logits).

No JAX here. Every decision depends only on the sequence of calls, so the processes of a multi-process
replica, which replay the same engine calls, keep identical tables.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model_service.requests import ErrorKind, SchedulerError


class OutOfBlocks(SchedulerError):
    """No free or evictable block is left (the scheduler preempts before this can happen): RESOURCE_EXHAUSTED."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorKind.RESOURCE_EXHAUSTED, f"KV memory is full: {detail}; retry later")


@dataclass(frozen=True)
class KVUsage:
    """Pool occupancy and prefix-cache counters, for metrics."""

    total: int  # blocks in the pool (the scratch block not counted)
    used: int  # held by at least one running sequence
    cached: int  # held by none, kept for the prefix cache (evictable)
    free: int  # neither
    queries: int  # prompt tokens looked up in the prefix cache
    hits: int  # of those, tokens served from it


def _chain(previous: bytes, tokens: Sequence[int]) -> bytes:
    """A block's cache key: its tokens and the key of the block before it (deterministic across processes)."""
    return hashlib.blake2b(previous + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class KVBlocks:
    """Block tables for `slots` sequences over a pool of `num_blocks` blocks."""

    def __init__(self, num_blocks: int, block_size: int, slots: int, table_len: int, chunk: int = 0,
                 caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one position, got {num_blocks} "
                             f"blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.table_len = table_len  # entries per table row (covers the largest attention bucket)
        self.scratch = num_blocks  # the pool's extra block: unused table entries point here
        self.chunk = chunk  # prefill chunk size: reuse ends on a multiple of it (0: no prefix reuse)
        self.caching = caching and chunk > 0
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, oldest first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tables: list[list[int]] = [[] for _ in range(slots)]
        self._array: np.ndarray | None = None  # `table()`, until a table changes
        self.queries = 0
        self.hits = 0

    # ---- queries ------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def available(self) -> int:
        """Blocks a new allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    def capacity(self, slot: int) -> int:
        """Positions the slot's blocks cover."""
        return len(self._tables[slot]) * self.block_size

    def blocks_of(self, slot: int) -> tuple[int, ...]:
        return tuple(self._tables[slot])

    def usage(self) -> KVUsage:
        used = self.num_blocks - len(self._free) - len(self._evictable)
        return KVUsage(self.num_blocks, used, len(self._evictable), len(self._free), self.queries, self.hits)

    def table(self) -> np.ndarray:
        """[slots, table_len] int32: every slot's blocks, the scratch block past them (built again only after a
        table changed: the decode loop asks every step). Read-only."""
        if self._array is None:
            out = np.full((len(self._tables), self.table_len), self.scratch, np.int32)
            for slot, blocks in enumerate(self._tables):
                out[slot, :len(blocks)] = blocks
            out.flags.writeable = False
            self._array = out
        return self._array

    def reusable(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a prompt the cache would serve (a multiple of the chunk, < len(tokens))."""
        if not self.caching or len(tokens) <= self.chunk:
            return 0
        limit = (len(tokens) - 1) // self.chunk * self.chunk
        return min(len(self._match(tokens, limit)) * self.block_size, limit) // self.chunk * self.chunk

    # ---- allocation ---------------------------------------------------------------------------
    def assign(self, slot: int, tokens: int, share_from: int | None = None, shared_tokens: int = 0) -> None:
        """Give `slot` blocks for `tokens` positions; with `share_from`, the blocks covering that slot's first
        `shared_tokens` positions (whole blocks only) are shared rather than allocated."""
        self.release(slot)
        shared: list[int] = []
        if share_from is not None:
            shared = self._tables[share_from][:shared_tokens // self.block_size]
        need = self.blocks_for(tokens) - len(shared)
        if need > self.available():
            raise OutOfBlocks(f"{need} KV blocks needed, {self.available()} available")
        for block in shared:
            self._take(block)
        self._tables[slot] = list(shared) + [self._allocate() for _ in range(max(0, need))]
        self._array = None

    def assign_prompt(self, slot: int, prompt: Sequence[int]) -> int:
        """Blocks for a prompt prefilled on the chunk grid, taking cached blocks for its leading tokens.
        Returns the number of tokens they hold (where the prefill starts)."""
        self.release(slot)
        reuse = self.reusable(prompt)
        if self.caching:
            self.queries += len(prompt)
            self.hits += reuse
        cached = self._match(prompt, reuse)[:reuse // self.block_size]
        need = self.blocks_for(len(prompt)) - len(cached)
        if need > self.available() - sum(1 for b in cached if b in self._evictable):
            raise OutOfBlocks(f"{need} KV blocks needed, {self.available()} available")
        for block in cached:
            self._take(block)
        self._tables[slot] = cached + [self._allocate() for _ in range(need)]
        self._array = None
        return reuse

    def grow(self, slot: int, tokens: int) -> None:
        """Make the slot's blocks cover `tokens` positions."""
        need = self.blocks_for(tokens) - len(self._tables[slot])
        if need > self.available():
            raise OutOfBlocks(f"{need} KV blocks needed to grow slot {slot}, {self.available()} available")
        if need > 0:
            self._tables[slot].extend(self._allocate() for _ in range(need))
            self._array = None

    def release(self, slot: int) -> None:
        """The slot's sequence ended: each of its blocks loses a holder; cached ones stay for reuse."""
        for block in self._tables[slot]:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None  # most recently used last
                else:
                    self._free[block] = None
        if self._tables[slot]:
            self._tables[slot] = []
            self._array = None

    def register(self, slot: int, prompt: Sequence[int], computed: int) -> None:
        """The slot's first `computed` positions hold `prompt`'s tokens, computed on the chunk grid: key its full
        blocks for reuse. A block whose content another block already holds stays unkeyed (freed when done)."""
        if not self.caching:
            return
        key = b""
        for i, block in enumerate(self._tables[slot][:min(computed, len(prompt)) // self.block_size]):
            key = _chain(key, prompt[i * self.block_size:(i + 1) * self.block_size])
            if block in self._key_of or key in self._block_of:
                continue
            self._key_of[block] = key
            self._block_of[key] = block

    # ---- internals ----------------------------------------------------------------------------
    def _match(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Cached blocks holding the prompt's leading full blocks, up to `limit` tokens, in order."""
        out: list[int] = []
        key = b""
        for i in range(limit // self.block_size):
            key = _chain(key, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self._block_of.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def _take(self, block: int) -> None:
        """One more holder of an existing block."""
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
            self._free.pop(block, None)
        self._refs[block] += 1

    def _allocate(self) -> int:
        """A block for new content: a free one, else the least recently used cached one (forgetting its key)."""
        if self._free:
            block, _ = self._free.popitem(last=False)
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        return block
