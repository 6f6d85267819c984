"""Studies made of many runs: `compare.py` (pslab compare), `sweep.py` (pslab sweep --knob), `staleness.py`
(pslab sweep --preset staleness), `momentum.py` (--preset momentum: asynchrony begets momentum, with z scores),
`coherence.py` (--preset coherence: gradient coherence per model depth)."""
