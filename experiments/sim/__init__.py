"""Virtual time: the PS simulator (`ps.py`, driving the real ps.ShardState) with its network model (`network.py`),
its timing-only mode (`timing.py`: the same event loop without tensors), the analytic staleness laws its histograms
are drawn against (`laws.py`), ring all-reduce BSP (`allreduce.py`), Local SGD and
DiLoCo (`local_sgd.py`: D model copies averaged every H steps), and the single-process staleness emulator of
Dai et al. with K workers (`dai.py`), its delay laws (`delays.py`) and gradient coherence (`coherence.py`); failures in
virtual time (`faults.py`: the detection and recovery model, `ps_faults.py`: its driver in the PS simulator)."""
