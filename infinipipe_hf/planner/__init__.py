"""Pure planning code: cost model, units, schedules, checkpoint solver, validator, simulator.

Nothing in this package imports ``torch`` or ``torch.distributed``; it is plain Python + numpy/scipy.
"""
