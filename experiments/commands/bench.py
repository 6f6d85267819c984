"""`pslab bench WHAT [...]`: benchmarks, each against a peer in the same run (gloo, torch RPC, DDP), printing ratios.

    pslab bench collectives   zmq ring collectives vs torch.distributed gloo (time, algbw, busbw, ratio)
    pslab bench ps            parameter-server push+pull rate vs the torch.distributed.rpc PS pattern
    pslab bench dp            data-parallel training samples/s vs torch DistributedDataParallel on gloo
    pslab bench engines       every engine (DP, ZeRO 1-3, TP, TP+SP, GPipe, 1F1B) vs PyTorch's own (DDP, FSDP2,
                              DTensor, pipelining): step time on both pslab backends, ratios, bytes per step
    pslab bench sim           timing-only simulator updates/s vs the training-mode simulator (same config)
    pslab bench topology      flat ring vs hierarchical all-reduce over an emulated slow inter-host link
    pslab bench trace         the same run with its timeline recorded ([trace]) and not: step time, ratio

Arguments after WHAT go to that benchmark (`pslab bench collectives --help`).
"""

from __future__ import annotations

import argparse
import importlib

BENCHES = {"collectives": "zmq collectives vs gloo", "ps": "parameter server vs torch RPC PS",
           "dp": "data parallel vs torch DDP", "engines": "the engines vs DDP / FSDP2 / DTensor / pipelining",
           "sim": "timing-only vs training-mode simulator",
           "topology": "flat ring vs hierarchical all-reduce, emulated hosts",
           "trace": "a run with its timeline recorded vs not"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks against a peer in the same run (collectives, ps, dp, engines, sim, topology, trace)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for that benchmark (try --help)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"pslab.experiments.bench.{args.what}")
    return int(module.main(list(args.rest)) or 0)
