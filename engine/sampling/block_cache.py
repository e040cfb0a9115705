"""The decode batch's KV cache: per layer, preallocated buffers [blocks, rows, kv heads, BLOCK, dim].

Row ``r``'s entries fill columns ``[0, positions[r])`` (column c lives in block c // BLOCK) and a
decode step writes its new token at column ``positions[r]``; the rest is zeros, or where only the
attention kernel reads the cache, whatever the allocation held (it reads nothing past a row's
position). Blocks lead so that
the first few are one contiguous tensor for :func:`~.row_invariant.decode_attention`, whatever the
capacity, and a decode step copies nothing that grows with length. Rows join (:meth:`append`) and
leave (:meth:`keep`) between steps. Where the decoder reads the cache through the attention kernel
(:attr:`BlockCache.by_place`), rows leave without moving a byte while most of the cache's rows are
still in the batch: the kernel finds each row's entries by :attr:`BlockCache.places`, and the
cache is compacted only once half its rows have left (rows finish a few at a time, so moving the
rest each time copied the whole cache ~once a step as a batch ran out).

The samples of one prompt have the same entries over the prompt's columns; the cache knows which
rows those are (:meth:`sharing`), so attention reads a prompt's entries from memory once for all
its samples (:func:`~.fused_ops.attend`), from the prompt's first row. Where only the kernel reads
the cache, that row alone holds them (the prompt's first row that stays gets a copy when it
leaves), so a prefill writes one row's prompt entries a prompt, not one a sample.
"""

from __future__ import annotations

import itertools

import torch

from sess.engine.sampling.row_invariant import BLOCK, decode_bias


class WriteStep:
    """Where one decode step writes each row's new entry: the same for every layer, so made once,
    together with attention's mask bias."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self.last = int(positions.max())
        self.blocks = self.last // BLOCK + 1
        self.rows = torch.arange(positions.shape[0], device=positions.device)
        self.block, self.column = positions // BLOCK, positions % BLOCK
        self._bias: torch.Tensor | None = None

    def bias(self, kv_heads: int) -> torch.Tensor:
        """:func:`~.row_invariant.decode_bias` of this step's positions."""
        if self._bias is None:
            self._bias = decode_bias(self.positions, self.blocks, kv_heads)
        return self._bias


_prompts = itertools.count()  # ids of the prompts whose entries rows share, unique in the process


class BlockCache:
    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        prompts: list[tuple[int, int] | None] | None = None,
        by_place: bool = False,
    ):
        self.keys, self.values = keys, values  # per layer [blocks, rows, kv heads, BLOCK, dim]
        # per row: (id, length) of the prompt whose entries its first columns hold, shared with
        # the other rows of that id; None: its entries are its own
        self.prompts = prompts if prompts is not None else [None] * keys[0].shape[1]
        self.step: WriteStep | None = None
        self._sharing: tuple[torch.Tensor, torch.Tensor] | None = None
        # whether rows may leave without their entries moving (the decoder reads through places)
        self.by_place = by_place
        # int64 [rows], ascending: the cache row that holds each row's entries, where rows left
        # in place (None: row r in cache row r, every cache row a row's)
        self.places: torch.Tensor | None = None

    @classmethod
    def from_prompts(
        cls,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        spans: list[tuple[int, int, int]],
        capacity: int,
        by_place: bool = False,
    ) -> BlockCache:
        """From a prefill's per-layer entries [tokens, kv heads, dim] of prompts laid end to end:
        ``spans`` gives each prompt's (first token, length, rows it gets); each of its rows starts
        with the prompt's entries at column 0, with room for ``capacity`` columns. The lists are
        used up (each layer's entries let go once blocked: a prefill of 64 prompts held 177 MB of
        them on smollm2 beside the new cache). ``by_place`` (see :attr:`by_place`): the reader is
        the attention kernel, which reads a row's prompt columns from its prompt's first row
        (:meth:`sharing`) and nothing past a row's position, so only that row gets the prompt's
        entries and the rest of the cache is left as allocated (written by the steps before
        read); else every row gets them, and zeros after."""
        blocks = -(-capacity // BLOCK)
        rows = sum(count for _, _, count in spans)

        def blocked(entries: torch.Tensor) -> torch.Tensor:
            _, heads, dim = entries.shape
            out = entries.new_empty(blocks, rows, heads, BLOCK, dim)
            row = 0
            for start, length, count in spans:
                used = -(-length // BLOCK) if by_place else blocks
                prompt = _pad(entries[start : start + length].transpose(0, 1), used * BLOCK, dim=1)
                prompt = prompt.reshape(heads, used, BLOCK, dim).permute(1, 0, 2, 3)
                if by_place:
                    out[:used, row] = prompt
                else:
                    out[:, row : row + count] = prompt[:, None]
                row += count
            return out

        _each_layer((keys, values), blocked)
        prompts = []
        for _, length, count in spans:
            prompts += [(next(_prompts), length)] * count
        return cls(keys, values, prompts, by_place)

    @property
    def blocks(self) -> int:
        return self.keys[0].shape[0]

    @property
    def held(self) -> int:
        """Rows the cache holds entries for (the batch's and, until compacted, ones that left)."""
        return self.keys[0].shape[1]

    def sharing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sources, lengths)``, int64 [rows]: row ``r``'s first ``lengths[r]`` columns hold the
        same entries as row ``sources[r]``'s (the first row of its prompt; itself, 0 columns, for a
        row of its own)."""
        if self._sharing is None:
            first: dict[int, int] = {}
            sources, lengths = [], []
            prompts = self.prompts if self.places is None else [self.prompts[p] for p in self.places.tolist()]
            for row, prompt in enumerate(prompts):
                sources.append(row if prompt is None else first.setdefault(prompt[0], row))
                lengths.append(0 if prompt is None else prompt[1])
            self._sharing = (torch.tensor(sources, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))
        return self._sharing

    def set_positions(self, positions: torch.Tensor) -> WriteStep:
        """Where this step writes (every layer's :meth:`update` uses it)."""
        self.step = WriteStep(positions)
        if self.step.blocks > self.blocks:
            grown = max(self.step.blocks, self.blocks + (self.blocks + 3) // 4)
            _each_layer((self.keys, self.values), lambda t: _pad(t, grown, dim=0))
        return self.step

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new entry [rows, kv heads, dim] of ``layer``; its keys and values up to
        this step's last block."""
        if self.by_place:  # rows may have left in place; a prompt's other rows lack its columns
            raise RuntimeError("a cache made for the attention kernel is read through the attention kernel only")
        step = self.step
        self.keys[layer][step.block, step.rows, :, step.column] = key
        self.values[layer][step.block, step.rows, :, step.column] = value
        return self.keys[layer][: step.blocks], self.values[layer][: step.blocks]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s whole keys and values [blocks, rows, kv heads, BLOCK, dim], contiguous, for a
        kernel that writes this step's entries itself (:mod:`.fused_ops`)."""
        for entries in (self.keys, self.values):
            entries[layer] = entries[layer].contiguous()
        return self.keys[layer], self.values[layer]

    def keep(self, rows: torch.Tensor, width: int) -> None:
        """Keep ``rows`` (ascending) of the batch's. With :attr:`by_place`, a prompt's entries go
        first to its first row that stays where its first row leaves (:meth:`_hand_over`), and
        while more than half the cache's rows stay, only :attr:`places` changes. Otherwise the
        rows' entries, and of their blocks enough for ``width`` columns and some growth, are
        compacted in the cache's own memory (:func:`_compact`) while at least half of it stays,
        else copied to a smaller cache: a new cache is fresh pages the kernel faults in one by one,
        ~200 ms a finished row at 64 rows and 2 blocks of smollm2."""
        if self.by_place:
            self._hand_over(rows)
        places = rows if self.places is None else self.places[rows]
        if self.by_place and 2 * places.shape[0] > self.held:
            self.places, self._sharing = places, None
            return
        self._move(places, min(self.blocks, 2 * (width // BLOCK + 1)))

    def _hand_over(self, rows: torch.Tensor) -> None:
        """Where a prompt's first row (the one :meth:`sharing` names, whose copy of the prompt's
        entries the others read, in a :attr:`by_place` cache) leaves and rows of that prompt stay
        (batch rows ``rows``, ascending), the first that stays gets the entries: it is the first
        row of the prompt from then on."""
        sources, lengths = (t.tolist() for t in self.sharing())
        places = self.places.tolist() if self.places is not None else range(self.held)
        staying, moved = set(rows.tolist()), set()
        for row in rows.tolist():
            source, length = sources[row], lengths[row]
            if source in staying or source in moved:
                continue
            moved.add(source)
            for entries in self.keys + self.values:
                for block in range(-(-length // BLOCK)):  # the prompt's columns only: after them, the row's own
                    columns = min(BLOCK, length - block * BLOCK)
                    entries[block, places[row], :, :columns] = entries[block, places[source], :, :columns]

    def _move(self, rows: torch.Tensor, keep: int) -> None:
        """Hold only the cache rows ``rows`` (ascending), in order, and ``keep`` blocks."""

        def kept(t: torch.Tensor) -> torch.Tensor:
            if 2 * keep * rows.shape[0] * t[0, 0].numel() < t.numel():
                return t[:keep, rows]  # most of it goes: a smaller copy frees the rest
            return _compact(t, rows, keep)

        _each_layer((self.keys, self.values), kept)
        self.prompts = [self.prompts[row] for row in rows.tolist()]
        self.places = None
        self._sharing = None

    def append(self, other: BlockCache) -> None:
        """Add ``other``'s rows after this cache's (rows that left in place go first)."""
        if self.places is not None:
            self._move(self.places, self.blocks)
        blocks = max(self.blocks, other.blocks)
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for layer, entries in enumerate(theirs):
                mine[layer] = torch.cat(
                    [_pad(mine[layer], blocks, dim=0), _pad(entries, blocks, dim=0)], dim=1
                )
                theirs[layer] = None  # the other cache is used up: its rows are in this one now
        self.prompts = self.prompts + other.prompts
        self._sharing = None


def _each_layer(lists: tuple[list[torch.Tensor], ...], change) -> None:
    """Replace each layer's tensor in ``lists`` (keys, then values) with ``change`` of it, one at a
    time: the old one is freed before the next is made, so resizing or building the cache needs one
    layer's worth of memory more, not a second cache (64 rows of smollm2's 30 layers: 12 MB, not
    360 MB)."""
    for entries in lists:
        for layer in range(len(entries)):
            entries[layer] = change(entries[layer])


def _compact(t: torch.Tensor, rows: torch.Tensor, blocks: int) -> torch.Tensor:
    """``t[:blocks, rows]`` ([blocks, rows, ...], contiguous; ``rows`` ascending) written over the
    start of ``t``'s own memory, block by block: block ``b``'s rows go to where nothing of blocks
    ``b`` and later is yet to be read, each gathered first (a block's worth at most, which the heap
    serves again) since its source and target can overlap."""
    size = rows.shape[0] * t[0, 0].numel()  # one block's kept rows
    flat = t.view(-1)
    for block in range(blocks):
        flat[block * size : (block + 1) * size] = t[block].index_select(0, rows).view(-1)
    return flat[: blocks * size].view(blocks, rows.shape[0], *t.shape[2:])


def _pad(t: torch.Tensor, width: int, *, dim: int) -> torch.Tensor:
    """``t`` padded with zeros at the end of ``dim`` to ``width``."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)
