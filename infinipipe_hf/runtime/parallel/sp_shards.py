"""Which tokens and which attention heads each sequence-parallel rank of a stage owns.

Pure arithmetic (no torch), shared by the unit builder, the stage runner and the Ulysses
all-to-alls, so every place that cuts a unit or a head range agrees by construction.

Tokens: a unit's concatenated tokens (all its segments, in order) are cut into ``sp_degree``
contiguous shards whose sizes differ by at most one; the first ``num_tokens % sp_degree`` ranks
take the extra token.  Uneven shards need no padding: the all-to-alls use explicit split sizes.
The one exception is a unit with fewer tokens than ranks: a rank without a token cannot run a
decoder layer (HF reshapes ``[1, 0, -1, head_dim]``), so each such rank runs one *pad* token
(id 0, position 0, no label).  Because the extra tokens go to the first ranks, the pads are the
last shards, and the attention drops them by keeping the first ``num_tokens`` gathered tokens;
their outputs never reach a loss, so they add exactly zero to every gradient.

Heads: query heads are cut into contiguous ranges at ``floor(r * heads / sp_degree)``: sizes
differ by at most one (52 heads at sp 8 run 6 or 7 per rank, instead of being refused), and
whenever ``sp_degree`` divides or is divided by the number of K/V heads the cuts fall on GQA
group boundaries (Qwen2.5-7B's 28 heads / 4 K/V heads at sp 8 split 3,4,3,4,... inside each
group, so no rank needs two K/V heads).  A rank receives the K/V heads its query heads use; a
K/V head used by several ranks is sent to each (replication, when ``kv_heads < sp_degree``).
When a rank's query heads do not map onto its K/V heads as equal consecutive groups (e.g. 32
heads, 8 K/V heads at sp 3), the rank expands K/V to one head per query head for the kernel
(``HeadShard.expand``), which costs that rank memory in attention but never changes results.
``sp_degree`` larger than the number of query heads would leave a rank without a head: refused.
When ``sp_degree`` is a larger multiple of the K/V heads, every rank has one K/V head, shared by
``ir.model_spec.kv_head_sharers`` consecutive ranks (which then shard the carried K/V store,
``kv_group.py``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenShards:
    """The split of one unit's ``num_tokens`` tokens over ``sp_degree`` ranks."""

    num_tokens: int
    sizes: tuple[int, ...]
    """Real tokens per rank (contiguous, in rank order)."""

    @property
    def local_sizes(self) -> tuple[int, ...]:
        """Tokens each rank runs: its real tokens, or one pad token when it has none."""
        return tuple(max(n, 1) for n in self.sizes)

    @property
    def padded_total(self) -> int:
        """Tokens of the gathered (head-sharded) sequence, pads included; pads are a suffix."""
        return sum(self.local_sizes)

    def range(self, sp_rank: int) -> tuple[int, int]:
        """``[start, end)`` of the unit's tokens that ``sp_rank`` owns (``start == end``: none)."""
        start = sum(self.sizes[:sp_rank])
        return start, start + self.sizes[sp_rank]


def token_shards(num_tokens: int, sp_degree: int) -> TokenShards:
    """Contiguous shards differing by at most one token; the first ranks take the remainder."""
    if num_tokens < 1 or sp_degree < 1:
        raise ValueError(f"need num_tokens >= 1 and sp_degree >= 1, got {num_tokens}, {sp_degree}")
    base, extra = divmod(num_tokens, sp_degree)
    return TokenShards(num_tokens, tuple(base + (1 if r < extra else 0) for r in range(sp_degree)))


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one SP rank computes."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    expand: tuple[int, ...] | None
    """``None`` when local query head ``i`` uses local K/V head ``i // (q heads / kv heads)``
    (what GQA kernels do); else, per local query head, the local K/V head it uses."""

    @property
    def num_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start


def head_shards(num_heads: int, num_kv_heads: int, sp_degree: int) -> tuple[HeadShard, ...]:
    """One ``HeadShard`` per SP rank (see the module docstring for the rules)."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} must be a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    if not 1 <= sp_degree <= num_heads:
        raise ValueError(f"sp_degree={sp_degree} would leave a sequence-parallel rank without an "
                         f"attention head: the model has {num_heads} query heads; use "
                         f"sp_degree <= {num_heads}")
    group = num_heads // num_kv_heads
    cuts = [r * num_heads // sp_degree for r in range(sp_degree + 1)]
    shards = []
    for r in range(sp_degree):
        qa, qb = cuts[r], cuts[r + 1]
        ka, kb = qa // group, (qb - 1) // group + 1
        uses = [h // group - ka for h in range(qa, qb)]
        per_kv = (qb - qa) // (kb - ka) if (qb - qa) % (kb - ka) == 0 else 0
        grouped = per_kv > 0 and uses == [i // per_kv for i in range(qb - qa)]
        shards.append(HeadShard(qa, qb, ka, kb, None if grouped else tuple(uses)))
    return tuple(shards)
