"""The paged KV cache's bookkeeping: fixed-size blocks, a free list, reference counts and prefix sharing.

The cache holds `num_blocks * block_size` token slots per layer; token `i` of a sequence lives in slot
`block_table[i // block_size] * block_size + i % block_size`. Blocks are handed out from a free list and come back
when their reference count drops to zero.

Prefix sharing (`allow_block_sharing`): once a block is full and computed, it is registered under a hash of all
the tokens up to its end (a chain: hash(previous block's hash, this block's tokens)), so equal hashes mean equal
keys and values. A new request whose prompt starts with the same blocks takes them (reference count + 1) instead
of computing them. The chain starts at the request's LoRA adapter (Sequence.adapter_id; None for the base model):
the same tokens under another adapter have other keys and values, so they never share blocks. A freed block keeps
its hash until the free list hands it out again, so a finished or preempted request's prefix stays reusable for as
long as memory allows (freed blocks are reused oldest first).

Contiguity (`place_contiguously`, on for the CPU): attention reads a sequence's keys fastest when its blocks are
consecutive in the cache (on the CPU the paged backend then attends a view of the cache instead of gathering a copy,
see paged_attention.py). So a new
sequence is placed next-fit at the start of a free run long enough for its whole life (prompt + max_new_tokens),
and the rest of that run is left for it to grow into: it is not taken from the free count (a soft reservation:
later placements start after it, but when memory runs short any free block is used, and a sequence whose blocks
are not consecutive is simply attended through a gathered copy). A growing sequence takes the block right after
its last one when that block is free.

Offers: Block, BlockManager, CacheTooSmallError.
"""

from __future__ import annotations

from gpuformers.engine.sequence import Sequence


class CacheTooSmallError(ValueError):
    """A request can never fit in the KV cache, even alone."""


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()  # kept with the hash so a hash collision cannot share wrong blocks


def chain_hash(previous: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((previous, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, allow_block_sharing: bool = True,
                 place_contiguously: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size={block_size} must be a power of two (16, 32, ..., 256)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allow_block_sharing = allow_block_sharing
        self.blocks = [Block(i) for i in range(num_blocks)]
        # An insertion-ordered dict used as an ordered set: O(1) removal when a prefix hit revives a free block.
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hits = 0  # blocks taken from the prefix cache instead of computed
        self.prefix_queries = 0  # full prompt blocks looked up
        # Next-fit placement of new sequences (see the module docstring) starts searching at the cursor. Off, blocks
        # come from the free list only, oldest freed first, which keeps cached prefixes longest (the GPU's choice:
        # its attention kernel reads blocks in place wherever they are).
        self.place_contiguously = place_contiguously
        self._cursor = 0

    # --- facts --------------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, seq: Sequence) -> None:
        """Raise CacheTooSmallError when the request could not finish even with the whole cache to itself."""
        if seq.max_tokens > self.capacity_tokens:
            raise CacheTooSmallError(
                f"request {seq.request_id!r} needs {seq.max_tokens} cached tokens ({len(seq.prompt_ids)} prompt + "
                f"{seq.params.max_new_tokens} new - 1) but the KV cache holds {self.capacity_tokens} "
                f"({self.num_blocks} blocks of {self.block_size}); shorten it, lower max_new_tokens, or give the "
                f"cache more memory (num_blocks / max_memory_percent)"
            )

    # --- allocation ---------------------------------------------------------------------------------------------

    def _take_free_block(self, block_id: int | None = None) -> int:
        """Take block_id (which must be free), or the free block freed longest ago."""
        if block_id is None:
            block_id = next(iter(self.free))
        del self.free[block_id]
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # its contents are about to be overwritten
        block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def match_prefix(self, seq: Sequence) -> int:
        """On admission of a sequence with no blocks: take the cached blocks its tokens start with.

        Returns the number of tokens found (a multiple of block_size). At least one token is always left to compute,
        because the step that computes the last token is the one that gives the logits to sample from.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        if not self.allow_block_sharing or seq.wants_prompt_logprobs:
            # A request still missing prompt logprobs computes every prompt position: a cached block has keys and
            # values but no logits. (Its own blocks are still registered for others, and once its prompt logprobs
            # are complete a recompute after a preemption takes hits again.)
            return 0
        tokens = seq.token_ids
        previous = seq.adapter_id
        for start in range(0, (len(tokens) - 1) // self.block_size * self.block_size, self.block_size):
            chunk = tuple(tokens[start:start + self.block_size])
            h = chain_hash(previous, chunk)
            self.prefix_queries += 1
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            self.prefix_hits += 1
            previous = h
        found = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = found
        seq.num_cached_tokens += found
        return found

    def chunk_limit(self, seq: Sequence, num_tokens: int) -> int:
        """How many of the num_tokens tokens the scheduler would compute next it may: all of them here; a model with
        mamba layers stops a chunk where a state snapshot is to be taken (state_slots.py)."""
        return num_tokens

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks the sequence needs so that its first num_tokens tokens have slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give the sequence slots for its first num_tokens tokens (call can_allocate first)."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self.free):
            raise RuntimeError(f"allocate: {needed} blocks needed, {len(self.free)} free (check can_allocate first)")
        if needed and not seq.block_table and self.place_contiguously:
            start = self._free_run(needed, max(needed, self.blocks_for(seq.max_tokens)))
            if start is not None:
                seq.block_table.extend(self._take_free_block(b) for b in range(start, start + needed))
                return
        for _ in range(needed):
            after = seq.block_table[-1] + 1 if seq.block_table and self.place_contiguously else None
            seq.block_table.append(self._take_free_block(after if after in self.free else None))

    def _free_run(self, needed: int, wanted: int) -> int | None:
        """Next-fit from the cursor: the start of the first run of `wanted` free blocks (or of the longest run of at
        least `needed`), and move the cursor past the `wanted` blocks. None when no run of `needed` exists."""
        n = self.num_blocks
        wanted = min(wanted, n)
        best_start, best_len = None, needed - 1
        position, scanned = self._cursor, 0
        while scanned < n:
            if position + wanted > n:  # wrap: a run never crosses the end of the cache
                scanned += n - position
                position = 0
                continue
            run = 0
            while run < wanted and position + run in self.free:
                run += 1
            if run == wanted:
                best_start, best_len = position, run
                break
            if run > best_len:
                best_start, best_len = position, run
            scanned += run + 1
            position += run + 1
            if position >= n:
                position = 0
        if best_start is not None:
            self._cursor = (best_start + best_len) % n
        return best_start

    def commit(self, seq: Sequence) -> None:
        """After a step: register the blocks that became full and computed, so later requests can share them."""
        size = self.block_size
        full = seq.num_computed_tokens // size
        if not self.allow_block_sharing or full <= len(seq.block_hashes):
            return  # (nearly every step of a decode: no block became full)
        for index in range(len(seq.block_hashes), full):
            chunk = tuple(seq.tokens(index * size, (index + 1) * size))
            previous = seq.block_hashes[-1] if seq.block_hashes else seq.adapter_id
            h = chain_hash(previous, chunk)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[index]]
            block.hash, block.token_ids = h, chunk
            self.hash_to_block.setdefault(h, block.block_id)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop the sequence's references (finished, cancelled or preempted); its progress is lost."""
        # Freed in reverse so that a sequence's tail blocks are reused before its head (the head is the prefix
        # another request is likeliest to share).
        for block_id in reversed(seq.block_table):
            self.release(block_id, seq)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def release(self, block_id: int, seq: Sequence) -> None:
        """Drop one reference of `seq` to a block; at none it goes back to the free list, its hash kept."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated (sequence {seq.request_id!r})")
        if block.ref_count == 0:
            self.free[block_id] = None

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
