"""Studies made of many runs: `compare.py` (pslab compare), `fairness.py` (its lr rule, --tune-lr's bracketing
grid, the seed-noise band), `sweep.py` (pslab sweep --knob), `staleness.py` (pslab sweep --preset staleness |
staleness-remedies) with `staleness_search.py` (exact steps-to-target, bracketing lr search, censored medians) and
`staleness_report.py` (tables, the four claims with a seed bootstrap, the plot), `momentum.py` (--preset momentum: asynchrony begets momentum, with z scores),
`coherence.py` (--preset coherence: gradient coherence per model depth), `ssp_straggler.py` (--preset ssp-straggler:
Ho's SSP under a persistent straggler, time to target vs s, with the fast workers' lead), `communication.py` (pslab
compare --preset communication: Local SGD, DiLoCo, top-k and PowerSGD next to BSP / SSP / ASP on a slow link, with
`communication_report.py`: tables, verdicts with a seed bootstrap, loss against bytes / time / samples)."""
