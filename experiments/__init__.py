"""pslab's experiments layer: the `pslab` command, workloads, the one training loop, the simulator, studies, results.

Where is X? (paths from here)

    cli.py, commands/<name>.py      `pslab <name>`: compare, run, sweep, report, export, server, secret, schedule,
                                    bench, workloads, memory, plan
    api.py                          the Python API: pslab.run / compare / load -> Run, Comparison (DataFrames)
    config.py                       RunConfig: [workload] [train] [stragglers] [parallel] [simulate] [faults]
                                    [topology] [logging], validation; the shipped example configs
    combinations.py                 which [parallel] / [topology] combinations run: the table of refusals, each's reason
    errors.py                       ExperimentError / ConfigError: one line, exit 1
    stragglers.py                   the step-time model (per-worker factors, transient slow-downs, random delays)
    runner.py                       `execute(cfg)`: one run into a run directory (real ranks or the simulator)
    configs/*.toml                  example configs; compare_default.toml is `pslab compare`'s default workload

    workloads/                      (model factory, dataset, per-worker batch schedule, seed) — identical everywhere
        data.py, models.py, schedule.py, quadratic.py (the emulator's exact test bed)
        user.py                     your own model and data: workload.name = "file.py:make_workload"

    strategies/                     real runs: every strategy through ONE loop
        loop.py                     the training loop every rank runs (the ps-asp worker loop is this one too)
        build.py                    config -> mesh, engine, sync strategy; `check_layout` for [parallel]
        spec.py                     strategy strings (ps-ssp:3 ...), the optimizer spec, torch.optim from it
        local.py                    LocalStrategy: K virtual workers in one process (the reference)
        ps.py                       PSSyncStrategy: zero-copy push_pull to one shard set per slot group
        launch.py                   start the shards + launch the ranks on this machine; summary fields
        elastic.py                  membership changes inside the loop: commits, agree, broadcast, the lr at N'
        resume.py                   engine checkpoints from the loop (faults.checkpoint_every), `pslab run --resume`
        roles.py                    under torchrun / SLURM: this process is one rank (multi-host)

    faults/                         failures: inject, detect, survive, record (RUN_DIR/events.jsonl)
        spec.py                     the [faults] section (on_failure, detect_s, events ...) and the event schema
        supervisor.py               in the launcher's parent: heartbeats, injected faults, on_failure, shards

    sim/                            virtual time, labelled as simulated
        ps.py                       discrete-event PS simulator (the real ps.ShardState)
        network.py                  the simulator's network model (links, latency, bandwidth)
        timing.py                   timing-only mode: ps.py's event loop without tensors (same records, ~10^5/s)
        laws.py                     analytic staleness laws (K - 1, Geometric(1/K), c(K - 1), SSP bounds)
        allreduce.py                ring all-reduce BSP in virtual time (with faults: rollback, shrink, replace)
        faults.py, ps_faults.py     the fault model in virtual time (detection and recovery costs), the PS side
        dai.py                      single-process staleness emulator, K workers (Dai et al. 2019)
        delays.py, coherence.py     its delay laws (uniform, constant, geometric, exponential); gradient coherence

    studies/                        experiments made of many runs
        compare.py                  `pslab compare`: sync vs async, with and without a straggler
        fairness.py                 the lr rule / --tune-lr (bracketing grid) and the seed-noise band
        sweep.py                    `pslab sweep --knob`: one config key over values and seeds
        staleness.py                `pslab sweep --preset staleness | staleness-remedies`: steps-to-target vs s
        staleness_search.py         exact steps-to-target, the bracketing lr search, censored medians
        staleness_report.py         its tables, the four claims checked with a seed bootstrap, the plot
        momentum.py, coherence.py   `--preset momentum` (asynchrony begets momentum), `--preset coherence`
        ssp_straggler.py            `--preset ssp-straggler`: Ho's SSP, time to target vs s, persistent straggler
        communication.py            `compare --preset communication`: Local SGD, DiLoCo, compression vs BSP/SSP/ASP
        communication_report.py     its tables, verdicts with a seed bootstrap, loss vs bytes / time / samples

    results/                        what runs leave behind
        rundir.py                   run directories, JSON-lines writers, environment capture
        records.py                  UpdateRecord (the one metrics schema), summaries, staleness assignment
        bytes.py                    bytes per step by kind, measured next to the formula
        plots.py, report.py         PNG plots and report.md
        faults.py                   the failure report: per failure detect / recover / lost, the timeline figure
        tensorboard.py              a run's records as TensorBoard scalars ([logging] tensorboard, pslab export)
        timeline.py                 a traced run ([trace], --trace): the processes' spans merged into trace.json
                                    (Perfetto), compute / comm / exposed / overlap per rank, the measured bubble
        gantt.py                    the timeline as a picture (pslab report, compare --trace)

    bench/                          `pslab bench`: collectives vs gloo / MPICH (--peers noflight: the flight
                                    recorder's price), ps vs torch RPC / Ray, dp vs DDP, engines vs DDP / FSDP2 /
                                    DTensor / pipelining, sim, topology, trace (a run traced vs not)

Imports point down: experiments -> ps / parallelism -> collectives.
"""
