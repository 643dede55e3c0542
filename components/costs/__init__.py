"""The costs library (not a process): the step-cost model learned from measured steps, and
the per-request output-length estimates; admission and the scheduler both predict with it."""
