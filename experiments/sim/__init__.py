"""Virtual time: the PS simulator (`ps.py`, driving the real ps.ShardState) with its network model (`network.py`),
ring all-reduce BSP (`allreduce.py`), and the single-process staleness emulator of Dai et al. (`dai.py`)."""
