"""pslab: a research and teaching platform for distributed training — one import namespace over the product's folders.

The folders stay at the top level of the checkout (the product's layout); installed, they are subpackages of this one,
so a user's own `experiments/` or `ps/` folder can never shadow them:

    pslab.collectives       process groups (our ZeroMQ ring, torch.distributed), the launcher, topology, auth
    pslab.ps                the sharded parameter server: push/pull client, shards, ASP/BSP/SSP, server optimizers
    pslab.parallelism       the engines (dp, tp + sp, cp, ep, pp, ZeRO 1-3, checkpointing), the mesh, the planner
    pslab.experiments       the `pslab` command, workloads, the one training loop, the simulator, studies, results

Imports point down these layers: experiments -> ps / parallelism -> collectives.

The Python API (pslab.experiments.api; its docstring is the manual):

    pslab.run(config, set=[...]) -> Run                 one run; .metrics .evals .events DataFrames, .summary dict
    pslab.compare(strategies=[...], ...) -> Comparison  the main job; .summary (a row per run), .metrics, .report
    pslab.load(path) -> Run | Comparison                a run directory or a compare folder, read back

From a source checkout without an install (`python -c "import pslab"` in the repository root) the four folders are
found beside this one: the package's search path includes the checkout's root when they are not inside it.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from pathlib import Path as _Path

DISTRIBUTION = "pslab-distributed"           # the name pip knows it by ("pslab" on the index is another project)
try:
    __version__: str = _metadata.version(DISTRIBUTION)
except _metadata.PackageNotFoundError:       # a source checkout that was never installed
    __version__ = "0+unknown"

_here = _Path(__file__).resolve().parent
if not (_here / "collectives").is_dir() and (_here.parent / "collectives" / "__init__.py").is_file():
    __path__.append(str(_here.parent))       # the checkout: pslab.ps is ../ps (an install maps it under pslab/)

__all__ = ["run", "compare", "load", "Run", "Comparison", "__version__"]


def __getattr__(name: str):  # lazy: `import pslab` stays light; the API (experiments/api.py) loads on first use
    if name in ("run", "compare", "load", "Run", "Comparison"):
        from pslab.experiments import api
        return getattr(api, name)
    raise AttributeError(f"module 'pslab' has no attribute {name!r}")
