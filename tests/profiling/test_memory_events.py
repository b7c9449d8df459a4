"""Peak memory rebuilt from allocator events: a known sequence by hand, then the profiler on CPU."""
import torch

from infinipipe_hf.profiling.memory_events import MemoryProbe, peak_from_events


def test_peak_of_a_known_sequence_of_allocations():
    # t: +1 MB, +2 MB (3), -1 MB (2), +4 MB (6: the peak), -2 MB (4), -4 MB (0)
    events = [(0.0, 1_000_000), (1.0, 2_000_000), (2.0, -1_000_000), (3.0, 4_000_000),
              (4.0, -2_000_000), (5.0, -4_000_000)]
    trace = peak_from_events(events)
    assert (trace.peak_bytes, trace.peak_time, trace.final_bytes, trace.num_events) == (6_000_000, 3.0, 0, 6)
    # Order comes from the times, not the list: shuffled input, same answer.
    assert peak_from_events(events[::-1]) == trace


def test_a_free_at_the_same_instant_as_an_allocation_keeps_the_given_order():
    assert peak_from_events([(1.0, 5), (1.0, -5), (1.0, 3)]).peak_bytes == 5
    assert peak_from_events([]).peak_bytes == 0


def test_probe_sees_transient_allocations_of_real_tensors():
    before = torch.empty(1_000_000)  # allocated before the probe: its free is not reported
    with MemoryProbe() as probe:
        a = torch.empty(250_000)  # 1 MB
        b = torch.empty(500_000)  # 2 MB -> 3 MB
        del a  # 2 MB
        c = torch.empty(1_000_000)  # 4 MB -> 6 MB: the peak
        del before, b, c
    assert probe.trace.peak_bytes == 6_000_000
    assert probe.trace.final_bytes == 0


def test_garbage_of_an_earlier_probe_is_not_freed_inside_a_later_one():
    """A block allocated while an earlier probe ran keeps its size in the allocator's table, so its
    free inside a later probe is reported (below zero); garbage held by a reference cycle is freed
    whenever the collector runs.  The probe collects it before it starts."""
    import gc

    class Cycle:
        def __init__(self):
            self.me = self

    with MemoryProbe():
        held = Cycle()
        held.tensor = torch.empty(1_000_000)  # 4 MB, kept by the cycle
    del held
    enabled = gc.isenabled()
    gc.disable()  # only the probe's own collection may run
    try:
        with MemoryProbe() as probe:
            y = torch.empty(250_000)  # 1 MB
            gc.collect()  # nothing left to collect: the cycle went before the block
    finally:
        if enabled:
            gc.enable()
    assert (probe.trace.peak_bytes, probe.trace.final_bytes) == (1_000_000, 1_000_000)
    assert min(nbytes for _, nbytes in probe.events) > 0
    del y


def test_probe_counts_what_an_op_frees_inside_itself():
    x = torch.randn(512, 512)
    with MemoryProbe() as probe:
        y = (x @ x).sum()  # the 1 MB product lives only inside this line
    assert probe.trace.peak_bytes >= 512 * 512 * 4
    assert probe.trace.final_bytes < 1024
    del y


def test_window_peaks_take_the_level_entering_each_window_and_its_highest_inside():
    from infinipipe_hf.profiling.memory_events import window_peaks

    events = [(1.0, 10), (2.0, 5), (2.5, -12), (4.0, 7), (6.0, -10)]  # levels 10, 15, 3, 10, 0
    assert window_peaks(events, [(0.0, 0.5), (0.5, 1.5), (1.5, 3.0), (3.0, 3.5), (3.9, 4.5), (5.0, 7.0)]) == [
        0, 10, 15, 3, 10, 10]
    assert window_peaks([], [(0.0, 1.0)]) == [0]
