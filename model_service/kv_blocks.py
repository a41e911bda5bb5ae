"""Paged KV memory's host side: which pool blocks each slot's sequence owns, and the prefix cache.

The device pool (kv_memory.py) holds `num_blocks` blocks of `block_size` positions per layer, plus one
scratch block (index `num_blocks`) that every unused table entry points at, so writes meant for nothing
land there. A slot's block table maps its positions to pool blocks: position p lives in block
table[p // block_size] at offset p % block_size. Blocks are allocated as a sequence grows and given back
when it ends; a block may be referenced by several tables (the samples of one prompt, or requests sharing
a cached prefix) and is reused only when no table holds it.

Prefix cache (vLLM's automatic prefix caching, SGLang's radix reuse), consulted for every prompt: a full block
once computed is keyed by a hash chain over its tokens and its prefix's key (a row's keys and values depend
only on the tokens up to it, whatever step computed them: engine.py). When its last holder ends it stays in
the pool, evictable in least-recently-used order, and a later prompt with the same leading tokens takes it
instead of recomputing. The chain starts from the request's salt (its cache_salt: a digest of the caller's API
key and vLLM's cache_salt), so requests of different tenants never share a block, and cannot time one
another's prompts. Reuse always leaves at least one prompt token to compute (the first draw needs its logits).

No JAX here. The scheduler owns the one instance (process 0 of a multi-process replica; the tables travel in
each step's batch).
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


def _root(salt: bytes) -> bytes:
    """Where a prompt's hash chain starts: b"" unsalted, else a 16-byte digest of the salt (its own hash domain,
    so that no salted key equals an unsalted one), so prompts under different salts never share a block."""
    return hashlib.blake2b(salt, digest_size=16, person=b"kv-cache-salt").digest() if salt else b""


PROMPT_KEYS = 64  # prompts whose block keys KVBlocks keeps between lookups (the running and queued ones)


class KVBlocks:
    """Block tables for `slots` sequences over a pool of `num_blocks` blocks."""

    def __init__(self, num_blocks: int, block_size: int, slots: int, table_len: int, caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one position, got {num_blocks} "
                             f"blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.table_len = table_len  # entries per table row (covers the largest attention bucket)
        self.scratch = num_blocks  # the pool's extra block: unused table entries point here
        self.caching = caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, oldest first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tables: list[list[int]] = [[] for _ in range(slots)]
        self._array: np.ndarray | None = None  # `table()`, until a table changes
        # (salt, tokens) -> their leading blocks' keys as far as hashed: the scheduler asks about every queued
        # prompt every step and registers a prompt after every chunk, so each block is hashed once, not each time
        self._prompt_keys: OrderedDict[tuple[bytes, tuple[int, ...]], list[bytes]] = OrderedDict()
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

    def reusable(self, tokens: Sequence[int], salt: bytes = b"") -> int:
        """How many leading tokens of a prompt the cache would serve (whole blocks, fewer than len(tokens)),
        counting only blocks registered under the same `salt` (the request's cache_salt)."""
        if not self.caching or len(tokens) <= self.block_size:
            return 0
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        return min(len(self._match(tokens, limit, salt)) * self.block_size, limit)

    # ---- allocation ---------------------------------------------------------------------------
    def share(self, slot: int, source: int, shared_tokens: int, positions: int) -> None:
        """Give `slot` blocks for `positions` positions, the ones covering `source`'s first `shared_tokens`
        positions (whole blocks) shared with it (the samples of one prompt)."""
        self.release(slot)
        shared = self._tables[source][:shared_tokens // self.block_size]
        need = self.blocks_for(positions) - len(shared)
        if need > self.available():
            raise OutOfBlocks(f"{need} KV blocks needed, {self.available()} available")
        for block in shared:
            self._take(block)
        self._tables[slot] = list(shared) + [self._allocate() for _ in range(max(0, need))]
        self._array = None

    def assign_prompt(self, slot: int, prompt: Sequence[int], positions: int, reuse: bool = True,
                      salt: bytes = b"") -> int:
        """Blocks for `positions` positions of a sequence starting with `prompt`, taking cached blocks for its
        leading tokens registered under the same `salt` (unless not `reuse`). Returns the number of tokens they
        hold (where computing starts)."""
        self.release(slot)
        served = self.reusable(prompt, salt) if reuse else 0
        if self.caching:
            self.queries += len(prompt)
            self.hits += served
        cached = self._match(prompt, served, salt)[:served // self.block_size]
        need = self.blocks_for(positions) - len(cached)
        if need > self.available() - sum(1 for b in cached if b in self._evictable):
            raise OutOfBlocks(f"{need} KV blocks needed, {self.available()} available")
        for block in cached:
            self._take(block)
        self._tables[slot] = cached + [self._allocate() for _ in range(need)]
        self._array = None
        return served

    def cost(self, prompt: Sequence[int], positions: int, reuse: bool = True, salt: bytes = b"") -> int:
        """Blocks `assign_prompt` would take from what is available (cached blocks nobody holds count)."""
        served = self.reusable(prompt, salt) if reuse else 0
        cached = self._match(prompt, served, salt)[:served // self.block_size]
        return self.blocks_for(positions) - len(cached) + sum(1 for b in cached if b in self._evictable)

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

    def register(self, slot: int, prompt: Sequence[int], computed: int, salt: bytes = b"") -> None:
        """The slot's first `computed` positions hold `prompt`'s tokens: key its full blocks for reuse under
        `salt`. A block whose content another block already holds stays unkeyed (freed when done)."""
        if not self.caching:
            return
        keys = self._chain_keys(salt, prompt)
        for i, block in enumerate(self._tables[slot][:min(computed, len(prompt)) // self.block_size]):
            key = self._key(keys, prompt, i, salt)
            if block in self._key_of or key in self._block_of:
                continue
            self._key_of[block] = key
            self._block_of[key] = block

    # ---- internals ----------------------------------------------------------------------------
    def _match(self, tokens: Sequence[int], limit: int, salt: bytes = b"") -> list[int]:
        """Cached blocks holding the prompt's leading full blocks under `salt`, up to `limit` tokens, in order."""
        out: list[int] = []
        keys = self._chain_keys(salt, tokens)
        for i in range(limit // self.block_size):
            block = self._block_of.get(self._key(keys, tokens, i, salt))
            if block is None:
                break
            out.append(block)
        return out

    def _key(self, keys: list[bytes], tokens: Sequence[int], i: int, salt: bytes) -> bytes:
        """The key of `tokens`' block i under `salt`, extending `keys` (their chain so far) as far as that."""
        while len(keys) <= i:
            j = len(keys)
            block = tokens[j * self.block_size:(j + 1) * self.block_size]
            keys.append(_chain(keys[-1] if keys else _root(salt), block))
        return keys[i]

    def _chain_keys(self, salt: bytes, tokens: Sequence[int]) -> list[bytes]:
        """The keys of `tokens`' leading blocks under `salt` hashed so far (`_key` extends them), kept for the
        PROMPT_KEYS prompts looked up last."""
        name = (salt, tokens if isinstance(tokens, tuple) else tuple(tokens))
        keys = self._prompt_keys.get(name)
        if keys is None:
            keys = self._prompt_keys[name] = []
            if len(self._prompt_keys) > PROMPT_KEYS:
                self._prompt_keys.popitem(last=False)
        else:
            self._prompt_keys.move_to_end(name)
        return keys

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
