"""Failures, as the article's last section promises: inject them, detect them, survive them, report them.

    spec.py        the [faults] section: on_failure, detect_s, heartbeat_s, commit_every, checkpoint_every,
                   shard_checkpoint_every, events = [{kill = "worker:2", at_step = 50}, ...]; one event schema
    events.py      EventLog: the one writer of RUN_DIR/events.jsonl (the supervisor and the simulator)
    supervisor.py  the launcher watches ranks and shards (heartbeats, exit codes), executes injected faults,
                   and applies on_failure: abort | continue | shrink | replace

Every failure becomes lines of RUN_DIR/events.jsonl (real runs and the simulator write the same schema, see
`spec.EVENT_FIELDS`): inject -> detect -> recover (-> join), with times since the run's start.

Bounds under load (collectives/launcher.py): a death is known at once from the kernel (a pidfd per process), never
from a missing result, and it is recorded before any survivor's "a peer failed"; a silent heartbeat is a hang only
past detect_s + 2 x lag, lag being how late the launcher's own 50 ms polls woke at worst over the last 10 s (a busy
machine delays the beats too); a stopped process (state T) is hung after detect_s whatever the load.
"""
