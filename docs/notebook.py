# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # pslab from a notebook: ring all-reduce vs the asynchronous parameter server
#
# The same comparison `pslab compare` makes, from Python: each strategy trains the same model on the same batches;
# only the synchronisation changes. Results come back as pandas DataFrames, read from the run directories (which
# stay the record: `pslab.load(folder)` reads them again, `pslab report` draws them).
#
# Open this file in Jupyter with jupytext (`pip install jupytext`; "Open as notebook"), or run it:
# `python docs/notebook.py [OUT]`. A script that starts runs needs no `if __name__ == "__main__":` guard in a
# notebook; in a plain script file, put the calls under one (multiprocessing re-imports a script's main module in
# the processes it starts).

# %%
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")                    # in Jupyter, drop this line to see the figure inline
import matplotlib.pyplot as plt

import pslab

out = Path(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else Path("runs/notebook")
print("pslab", pslab.__version__, "->", out)

# %% [markdown]
# ## Run the comparison
#
# `compare_default` is the workload `pslab compare` uses: digits, a small MLP, K = 4 workers. Two strategies,
# no straggler, a short run: about 20 s on 2 cores. `set=` takes the same `section.key=value` strings as `--set`.

# %%
c = pslab.compare(strategies=["allreduce", "ps-asp"], straggler=False, noise_seeds=0, progress=False,
                  set=["train.steps=40", "train.eval_every=10"], out=out)
c

# %% [markdown]
# ## One row per run
#
# `c.summary` flattens each run's summary.json: throughput, time, final accuracy, staleness, bytes.

# %%
cols = ["label", "strategy", "updates", "time_s", "updates_per_s", "final_test_acc", "staleness_mean"]
table = c.summary[[k for k in cols if k in c.summary.columns]]
print(table.to_string(index=False))

# %% [markdown]
# ## Loss against wall-clock time
#
# Every update is a row of `c.metrics` (a `run` column says whose). ps-asp applies each worker's gradient at once
# (staleness > 0), allreduce averages all four per step (staleness 0): more updates per second, each noisier.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for run, rows in c.metrics.groupby("run"):
    ax.plot(rows["time_s"], rows["loss"].rolling(8, min_periods=1).mean(), label=run)
ax.set_xlabel("time (s)")
ax.set_ylabel("training loss (rolling mean of 8 updates)")
ax.legend()
fig.tight_layout()
fig.savefig(out / "loss_by_strategy.png", dpi=100)

# %% [markdown]
# ## Staleness, per update
#
# The staleness of an update is how many other updates reached the parameters between this worker's read and its
# write; under ASP with K workers its mean is about K − 1 (docs/tutorial.md §2).

# %%
print(c.metrics.groupby("run")["staleness"].describe()[["mean", "max"]].to_string())

# %% [markdown]
# ## Read it back later
#
# The folder is the record: `pslab.load` returns the same Comparison (and a single run directory as a `Run`).

# %%
again = pslab.load(out)
assert again.summary.equals(c.summary) and again.metrics.equals(c.metrics)
print("notebook: done", again)
