"""`pslab bench WHAT`: benchmarks, each against a peer in the same run, printing ratios (never run by the tests
except as smoke tests): `collectives.py` (zmq ring collectives vs gloo), `ps.py` (the parameter server vs the
torch.distributed.rpc PS pattern), `dp.py` (the data-parallel engine vs torch DDP), `sim.py` (the timing-only simulator
vs the training-mode one)."""
