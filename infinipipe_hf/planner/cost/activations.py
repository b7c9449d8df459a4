"""Bytes of one pipeline stage, per GPU: model states, kept activations, KV store, working set.

Memory of a stage = model states + for every unit alive in its window the activations it keeps
(non-checkpointed layers keep ``act_bytes_per_token`` per token, checkpointed ones only their
input), the KV store (K/V of slices whose sequence continues, and their pending gradients) and
the transient working set of the action running now (one layer's peak, a recompute, a chunk of
logits).  Per-token figures come from the profile's reference layer, scaled by the activation
element count of :func:`act_elements`; under Ulysses SP a GPU holds ``ceil(T / sp)`` tokens
(:mod:`ulysses`), with FSDP2 its states are sharded (:mod:`states`).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.profile import HardwareProfile, reference_spec
from infinipipe_hf.planner.cost.states import ShardedStates
from infinipipe_hf.planner.cost.ulysses import UlyssesCost, tokens_per_gpu


def act_elements(hidden_size: int, intermediate_size: int, kv_dim: int, bytes_per_element: float = 2) -> float:
    """Activation elements per token a Llama layer saves, in the activation dtype.

    Each RMSNorm keeps its input upcast to float32 (``4 / bytes_per_element`` elements; in float32
    the input itself) and its normalised output (1); the q/k/v input, SDPA's query and output
    (``o_proj`` reads the output in place), the MLP input (4 with the two norms' ``2 * 3`` in
    bf16: ``10 * hidden``); K and V (``2 * kv_dim``); the MLP's gate, act, up and product
    (``4 * intermediate``).  The tests check it against ``saved_tensors_hooks``.
    """
    return (2 * norm_elements(bytes_per_element) + 4) * hidden_size + 4 * intermediate_size + 2 * kv_dim


def norm_elements(bytes_per_element: float = 2) -> float:
    """Elements per hidden element an RMSNorm keeps: its float32 input and its normalised output
    (in float32 the input itself; in float64 HF's float32 cast is a narrower copy: half an element)."""
    return 2 if bytes_per_element == 4 else 4 / bytes_per_element + 1


def attention_tiled_elements(hidden_size: int, kv_dim: int) -> float:
    """Activation elements per token a layer whose token-wise parts run in tiles
    (``runtime/recompute/tiled_attention.py``) keeps across the unit: what the attention kernel
    saves (q, k, v, its output) and the layer input the tiles read."""
    return 3 * hidden_size + 2 * kv_dim


def _act_elements(spec: ModelSpec, bytes_per_element: float = 2) -> float:
    """:func:`act_elements` of ``spec``'s layer, bf16 unless told."""
    return act_elements(spec.hidden_size, spec.intermediate_size, spec.kv_dim, bytes_per_element)


LOSS_BLOCK_ROWS = 1024
"""Rows of a loss chunk's logits the runtime's fused cross-entropy upcasts at a time
(``runtime/stage/loss.py``'s constant of the same name; a test keeps them equal)."""


def largest_fitting(fits: Callable[[int], bool], cap: int) -> int:
    """The largest ``n <= cap`` with ``fits(n)`` (0 when not even 1 fits), for ``fits`` true up to a
    limit (bytes grow with the tokens): doubling from 1, then bisection of the last octave."""
    lo, hi = 0, 1
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class StageActivations:
    """Bytes of the actions of one stage, per GPU (module docstring)."""

    def __init__(self, spec: ModelSpec, profile: HardwareProfile, dims: ParallelDims,
                 layers_per_stage: list[int], states: ShardedStates, *, loss_chunk_tokens: int = 4096,
                 ulysses: UlyssesCost | None = None, group_size: int | None = None):
        p = profile
        self.spec = spec
        self.profile = profile
        self.pp_degree = dims.pp_degree
        self.sp_degree = dims.sp_degree if group_size is None else group_size
        """Ranks a unit's tokens are split over: the stage's SP group, or a sub-group of it."""
        self.layers_per_stage = layers_per_stage
        self.states = states
        self.loss_chunk_tokens = loss_chunk_tokens
        ref = reference_spec(p)
        self.act_ratio = _act_elements(spec, p.bytes_per_element) / _act_elements(ref, p.bytes_per_element)
        """Activation bytes of ``spec``'s layer over the reference layer's (per token)."""
        self.act_bytes_per_token = p.activation_bytes_per_token_per_layer * self.act_ratio
        self.layer_working_bytes_per_token = p.layer_working_bytes_per_token * self.act_ratio
        # The MLP's g, act(g), u and product, a share of the measured whole layer (as the levels count
        # it): what a tiled MLP holds for a tile of tokens instead of the unit's.
        mlp_share = 4 * spec.intermediate_size / _act_elements(spec, p.bytes_per_element)
        self.mlp_bytes_per_token = mlp_share * p.activation_bytes_per_token_per_layer * self.act_ratio
        self.hidden_bytes_per_token = spec.hidden_size * p.bytes_per_element
        # The attention output (activation dtype) and the log-sum-exp (float32 from the GPU
        # kernels, the compute dtype on CPU) per GPU token: under Ulysses a GPU keeps its heads
        # of all the unit's tokens, the same count as all heads of its own tokens.
        self.kept_attention_bytes_per_token = (self.hidden_bytes_per_token
                                               + spec.num_attention_heads * max(4.0, p.bytes_per_element))
        """Bytes per GPU token a ``keep_attn`` layer keeps beyond a whole-layer checkpoint's input."""
        attn_share = attention_tiled_elements(spec.hidden_size, spec.kv_dim) / _act_elements(spec, p.bytes_per_element)
        self.attention_tiled_bytes_per_token = attn_share * p.activation_bytes_per_token_per_layer * self.act_ratio
        """What a kept layer with its attention side in tiles keeps per token (a share of the measured layer)."""
        self.kv_bytes_per_token_per_layer = 2 * spec.kv_dim * p.bytes_per_element
        """K/V of one token of one layer a GPU's attention reads (its K/V heads, whole)."""
        self.kv_store_share = 1
        """Ranks sharing one K/V head's store of earlier slices (:attr:`UlyssesCost.kv_store_share`)."""
        if ulysses is not None:
            self.act_bytes_per_token *= ulysses.activation_scale(_act_elements(spec, p.bytes_per_element))
            self.kv_bytes_per_token_per_layer = ulysses.kv_bytes_per_token_per_layer()
            self.kv_store_share = ulysses.kv_store_share
            # While an all-to-all runs, q, k, v exist in both layouts: the received copy is extra.
            self.layer_working_bytes_per_token += sum(ulysses.all_to_all_bytes_per_token()[:3])
        self.kv_store_bytes_per_token_per_layer = self.kv_bytes_per_token_per_layer / self.kv_store_share
        """K/V of one token of one layer a GPU's KV store keeps (its chunk of a shared head's)."""

    @staticmethod
    def from_stage(ctx, cost) -> "StageActivations":
        """The stage's part (:mod:`.model`)."""
        return StageActivations(ctx.spec, ctx.profile, ctx.dims, list(ctx.layers_per_stage), cost.states,
                                loss_chunk_tokens=ctx.loss_chunk_tokens, ulysses=cost.ulysses,
                                group_size=ctx.group_size)

    def gpu_tokens(self, tokens: int) -> int:
        """Tokens of a unit of ``tokens`` on the busiest GPU of a stage (``ceil(tokens / sp)``)."""
        return tokens if self.sp_degree == 1 else tokens_per_gpu(tokens, self.sp_degree)

    def stage_params(self, stage_index: int) -> int:
        spec = self.spec
        n = self.layers_per_stage[stage_index] * spec.layer_params
        if stage_index == 0:
            n += spec.embedding_params
        if stage_index == self.pp_degree - 1:
            n += spec.hidden_size
            # A tied head on a single stage shares the embedding; on a separate stage it is a copy.
            if not (spec.tie_word_embeddings and self.pp_degree == 1):
                n += spec.embedding_params
        return n

    def static_bytes(self, stage_index: int) -> float:
        """Model states: weights, gradients and optimizer states of the stage (per GPU: sharded
        ones with FSDP2's unsharded gradients and working copies, see :mod:`states`)."""
        if self.states.sharded or self.states.offloaded:
            return self.states.peak_static_bytes(stage_index)
        return self.stage_params(stage_index) * self.profile.state_bytes_per_param

    def activation_bytes(self, stage_index: int, tokens: int, checkpointed_layers: int,
                         mlp_tiled: bool = False, attention_tiled: bool = False) -> float:
        """Bytes a unit keeps alive on the stage from its forward to its backward (``mlp_tiled``:
        its MLP runs in checkpointed tiles, so a layer that is not checkpointed keeps no MLP
        intermediate; ``attention_tiled``: its token-wise parts do, so such a layer keeps only
        :func:`attention_tiled_elements`)."""
        layers = self.layers_per_stage[stage_index]
        assert 0 <= checkpointed_layers <= layers, (checkpointed_layers, layers)
        tokens = self.gpu_tokens(tokens)
        kept = self.act_bytes_per_token - (self.mlp_bytes_per_token if mlp_tiled else 0.0)
        if attention_tiled:
            kept = min(kept, self.attention_tiled_bytes_per_token)
        per_token = ((layers - checkpointed_layers) * kept
                     + checkpointed_layers * self.hidden_bytes_per_token)
        if stage_index == self.pp_degree - 1:
            # The final norm's saved tensors and its output, the chunked (checkpointed) head's input.
            per_token += self.hidden_bytes_per_token * (norm_elements(self.profile.bytes_per_element) + 1)
        return tokens * per_token

    def activation_bytes_per_checkpointed_layer(self, stage_index: int, tokens: int) -> float:
        """Bytes saved by checkpointing one more layer of the unit (the solver's slope)."""
        return self.gpu_tokens(tokens) * (self.act_bytes_per_token - self.hidden_bytes_per_token)

    def context_bytes_per_layer(self, segments: Iterable[Segment]) -> float:
        """Extra bytes one non-checkpointed layer saves for segments that attend to context.

        The attention concatenates a slice's context K/V (read from the KV store) with its own and
        autograd keeps that concatenation for backward: ``2 * start * kv_dim`` elements beyond the
        slice's own K/V, which the per-token figure already counts.  Backends that need an explicit
        lower-right mask also keep it (``attention_mask_bytes_per_element`` per query-key pair).
        With ``attention_segment_outputs_kept`` (the SDPA fallback) a unit of several segments
        also keeps its attention output twice.  A checkpointed layer keeps none of these (its
        forward reruns in backward).
        """
        segments = tuple(segments)
        total = 0.0
        if self.profile.attention_segment_outputs_kept and len(segments) > 1:
            total += self.gpu_tokens(sum(s.end - s.start for s in segments)) * self.hidden_bytes_per_token
        mask_bpe = self.profile.attention_mask_bytes_per_element
        for seg in segments:
            if seg.start > 0:
                total += seg.start * self.kv_bytes_per_token_per_layer
                if mask_bpe:
                    total += mask_bpe * (seg.end - seg.start) * seg.end
        return total

    def context_read_bytes(self, segments: Iterable[Segment]) -> float:
        """Bytes a layer's read of the unit's context holds while the layer runs, beside what it
        keeps: the context K/V put together from the store and their concatenation with the
        slice's own (two copies of the context); with a shared K/V head's store also the
        exchange's buffers (:meth:`context_exchange_bytes`)."""
        context = sum(s.start for s in segments if s.start)
        return 2 * context * self.kv_bytes_per_token_per_layer + self.context_exchange_bytes(segments)

    def context_exchange_bytes(self, segments: Iterable[Segment]) -> float:
        """With a shared K/V head's store (:attr:`kv_store_share` ``r`` > 1), what the read's exchange
        adds (``runtime/attention/kv_shards.py``): one context-sized buffer (the all-gather's
        receive buffer, or the reduce-scatter's send buffer) and the rank's own padded chunks
        (forward) or their summed gradient and its copies (backward), two ``1 / r`` at most."""
        r = self.kv_store_share
        if r == 1:
            return 0.0
        return sum(s.start for s in segments if s.start) * self.kv_bytes_per_token_per_layer * (1 + 2 / r)

    def unit_activation_bytes(self, stage_index: int, segments: Sequence[Segment],
                              checkpointed_layers: int, mlp_tiled: bool = False,
                              attention_tiled: bool = False) -> float:
        """:meth:`activation_bytes` of a unit with these segments, context copies included."""
        tokens = sum(seg.end - seg.start for seg in segments)
        act = self.activation_bytes(stage_index, tokens, checkpointed_layers, mlp_tiled, attention_tiled)
        extra = self.context_bytes_per_layer(segments)
        if extra:
            act += (self.layers_per_stage[stage_index] - checkpointed_layers) * extra
        return act

    def unit_checkpoint_saving(self, stage_index: int, segments: Sequence[Segment]) -> float:
        """Bytes saved by checkpointing one more layer of a unit with these segments."""
        tokens = sum(seg.end - seg.start for seg in segments)
        return (self.activation_bytes_per_checkpointed_layer(stage_index, tokens)
                + self.context_bytes_per_layer(segments))

    def tiled_mlp_bytes(self, gpu_tokens: int, mlp_tile_tokens: int, backward: bool) -> float:
        """Bytes of one MLP tile while it runs: its intermediates and its share of the layer's working
        set, in backward also the intermediates' gradients (the tile reruns its gate and up)."""
        tile = min(gpu_tokens, mlp_tile_tokens)
        mlp = self.mlp_bytes_per_token
        share = mlp / self.act_bytes_per_token
        return tile * (self.layer_working_bytes_per_token * share + mlp * (2 if backward else 1))

    def tiled_layer_bytes(self, gpu_tokens: int, tile_tokens: int, backward: bool) -> tuple[float, float, float]:
        """A layer with its attention side in tiles: (bytes per token it holds across the unit,
        its working bytes per token, bytes of one tile while it runs).  Across the unit: what the
        kernel keeps (:attr:`attention_tiled_bytes_per_token`), its share of the working set, and in
        backward one more hidden state (the input's gradient summed over the tiles); a tile holds
        the rest of the layer for its tokens, in backward with their gradients."""
        kept = self.attention_tiled_bytes_per_token
        share = kept / self.act_bytes_per_token
        tile = min(gpu_tokens, tile_tokens) * ((1 - share) * self.layer_working_bytes_per_token
                                               + (self.act_bytes_per_token - kept) * (2 if backward else 1))
        work = self.layer_working_bytes_per_token * share + (self.hidden_bytes_per_token if backward else 0.0)
        return kept, work, tile

    def kv_bytes(self, stage_index: int, continuing_tokens: int) -> float:
        """KV-store bytes for tokens whose K/V later slices need: K/V plus pending gradients (this
        rank's chunk when the ranks sharing a K/V head share its store)."""
        return 2 * continuing_tokens * self.layers_per_stage[stage_index] * self.kv_store_bytes_per_token_per_layer

    def unit_peak_bytes(self, stage_index: int, tokens: int, checkpointed_layers: int) -> float:
        """A unit's own peak on the stage: what it keeps from forward to backward plus its backward's
        working set (with the model states, the peak of a stage running that unit alone)."""
        return (self.activation_bytes(stage_index, tokens, checkpointed_layers)
                + self.working_bytes(stage_index, tokens, checkpointed_layers, backward=True))

    def rebuilt_bound_bytes(self, stage_index: int, tokens: int, **tiles) -> float:
        """What :meth:`working_bytes`' backward bound counts for the layer a unit with a checkpointed
        layer rebuilds (the bound at one checkpointed layer less at none): a unit with nothing
        checkpointed rebuilds none.  ``tiles``: the tile sizes :meth:`working_bytes` takes."""
        return (self.working_bytes(stage_index, tokens, 1, True, **tiles)
                - self.working_bytes(stage_index, tokens, 0, True, **tiles))

    def working_bytes(self, stage_index: int, tokens: int, checkpointed_layers: int, backward: bool,
                      mlp_tile_tokens: int | None = None, attention_tile_tokens: int | None = None) -> float:
        """Transient bytes while the unit's forward or backward runs on the stage (the linear
        bound; :mod:`working` holds the phase model of profiles that measured it).  With
        ``mlp_tile_tokens`` the MLP's intermediates (and its share of the working set) count for
        one tile of tokens, not the unit's: in forward a tile's intermediates, in backward a tile's
        rerun intermediates and their gradients (:meth:`tiled_mlp_bytes`); with
        ``attention_tile_tokens`` every token-wise part does (:meth:`tiled_layer_bytes`)."""
        tokens = self.gpu_tokens(tokens)
        act, work, tile = self.act_bytes_per_token, self.layer_working_bytes_per_token, 0.0
        if attention_tile_tokens:
            act, work, tile = self.tiled_layer_bytes(tokens, attention_tile_tokens, backward)
        elif mlp_tile_tokens:
            tile = self.tiled_mlp_bytes(tokens, mlp_tile_tokens, backward)
            act -= self.mlp_bytes_per_token
            work *= act / self.act_bytes_per_token
        per_token = work + 2 * self.hidden_bytes_per_token
        if backward:
            # Gradients of one layer's activations exist while it runs backward; a checkpointed
            # layer first rebuilds its activations.
            per_token += act * (2 if checkpointed_layers else 1)
        w = tokens * per_token + tile
        if stage_index == self.pp_degree - 1:
            w += self.loss_chunk_bytes(tokens)
        return w

    def loss_chunk_bytes(self, gpu_tokens: int) -> float:
        """Bytes one chunk of the chunked loss (``runtime/stage/loss.py``) holds while it runs on
        ``gpu_tokens`` tokens, forward or backward alike: its logits in the activation dtype and one
        block of ``LOSS_BLOCK_ROWS`` rows in float32 (the fused cross-entropy's upcast; measured
        with the allocator's events: ``tests/planner/cost/test_loss_chunk_memory.py``)."""
        rows = min(gpu_tokens, self.loss_chunk_tokens)
        bpe = self.profile.bytes_per_element
        return self.spec.vocab_size * (rows * bpe + min(rows, LOSS_BLOCK_ROWS) * max(bpe, 4))
