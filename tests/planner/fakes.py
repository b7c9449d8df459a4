"""Cost models with fixed action times, for planner tests whose expected figures are worked out by hand.

``FakeCost`` answers what the simulator asks; ``UniformCost`` adds what the pipeline estimate reads.
A fake is its own parts (``compute``, ``acts``, ``coefficients`` are the fake itself).
"""
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.compute import UnitShape


class FakeCost:
    """Fixed times per action (independent of the unit), optional transfer and per-layer recompute."""

    def __init__(self, pp, tf=1.0, tb=2.0, transfer=0.0, recompute_per_layer=0.25, layers=4):
        self.dims, self.tf, self.tb, self.transfer = ParallelDims(pp_degree=pp), tf, tb, transfer
        self.rc, self.layers_per_stage, self.memory_budget_bytes = recompute_per_layer, [layers] * pp, 100.0

    @property
    def compute(self):
        return self

    acts = coefficients = compute

    def forward_time(self, stage, shape):
        return self.tf

    def recompute_time(self, stage, shape, c):
        return self.rc * c

    def backward_time(self, stage, shape, c=0):
        return self.tb + self.recompute_time(stage, shape, c)

    def transfer_time(self, tokens):
        return self.transfer

    def shape_of(self, segments):
        return UnitShape.of(segments)

    def static_bytes(self, stage):
        return 10.0

    def kv_bytes(self, stage, tokens):
        return 0.0

    def working_bytes(self, stage, tokens, c, backward):
        return 1.0

    def activation_bytes(self, stage, tokens, c):
        return 5.0 - c

    def context_bytes_per_layer(self, segments):
        return 0.0

    def unit_activation_bytes(self, stage, segments, c):
        return self.activation_bytes(stage, sum(s.end - s.start for s in segments), c)


class UniformCost(FakeCost):
    """FakeCost (F and B fixed per unit, equal on every stage) plus what the estimator reads."""

    def slowest_stage_time(self, shape):
        return self.tf + self.tb

    def num_layers(self, stage):
        return self.layers_per_stage[stage]

    def unit_checkpoint_saving(self, stage, segments):
        return 1.0  # activation_bytes is 5 - c: one byte per checkpointed layer

    def layer_fwd(self, pairs, tokens):
        return self.rc
