"""Studies made of many runs: `compare.py` (pslab compare), `sweep.py` (pslab sweep --knob), `staleness.py`
(pslab sweep --preset staleness)."""
