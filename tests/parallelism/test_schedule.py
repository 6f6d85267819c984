"""Pipeline schedules as data: structure, bubble of the virtual-time replay, in-flight activations, the picture."""

from __future__ import annotations

import pytest

from pslab.parallelism.schedule import (Action, PipelineSchedule, ScheduleError, gpipe, interleaved_1f1b, make_schedule,
                                  one_f_one_b, simulate)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_replay_bubble_equals_formula(name, p, m):
    """With equal stage times the replayed bubble is exactly (p−1)/(m+p−1), for any backward/forward time ratio."""
    sched = make_schedule(name, p, m)
    for tb in (1.0, 2.0):
        tl = simulate(sched, 1.0, tb)
        assert tl.makespan == pytest.approx((m + p - 1) * (1 + tb))
        assert tl.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_in_flight(p, m):
    """GPipe holds all m micro-batches on every stage; 1F1B holds min(p−s, m) on stage s, never more than p."""
    assert gpipe(p, m).peak_in_flight() == [m] * p
    peaks = one_f_one_b(p, m).peak_in_flight()
    assert peaks == [min(p - s, m) for s in range(p)]
    assert max(peaks) <= p


def test_1f1b_shape():
    """1F1B on stage 0 of 4 with 8 micro-batches: 3 warm-up forwards, then F/B alternation, then cool-down."""
    acts = [f"{a.phase}{a.micro}" for a in one_f_one_b(4, 8).for_stage(0)]
    assert acts == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "F6", "B3", "F7", "B4", "B5", "B6", "B7"]
    last = [f"{a.phase}{a.micro}" for a in one_f_one_b(4, 8).for_stage(3)]
    assert last[:4] == ["F0", "B0", "F1", "B1"]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_interleaved_replay_bubble_equals_formula(p, v, k):
    """Interleaved 1F1B, m = k·p micro-batches, v chunks per stage each taking 1/v of a stage's time: the replay never
    deadlocks, its makespan is (m + (p−1)/v)(t_f + t_b) and its bubble exactly (p−1)/(v·m+p−1) — v times smaller
    a fill and drain than 1F1B's; stage s holds min(2(p−s−1) + (v−1)p + 1, v·m) chunk-micro-batches at its peak
    (Megatron-LM's warm-up + 1), the figure memory_model.Layout.in_flight divides by v."""
    from pslab.parallelism.memory_model import Layout
    m = k * p
    sched = make_schedule("1f1b", p, m, v)
    assert sched.name == "interleaved-1f1b" and sched.virtual_stages == v
    for tb in (1.0, 2.0):
        tl = simulate(sched, 1.0, tb)
        assert tl.makespan == pytest.approx((m + (p - 1) / v) * (1 + tb))
        assert tl.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
    assert sched.theoretical_bubble() == pytest.approx((p - 1) / (v * m + p - 1))
    peaks = sched.peak_in_flight()
    assert peaks == [min(2 * (p - s - 1) + (v - 1) * p + 1, v * m) for s in range(p)]
    lay = Layout(pp=p, micro_batches=m, virtual_stages=v)
    assert [lay.in_flight(s) * v for s in range(p)] == pytest.approx(peaks)


def test_interleaved_order_is_megatrons():
    """p = 2, m = 4, v = 2 on stage 0: forwards in groups of p per chunk (F0 F1 on chunk 0, then chunk 1), warm-up
    2(p−1) + (v−1)p = 4, backwards with the chunks reversed; a micro-batch's chunk 0 on stage 1 feeds chunk 1 on
    stage 0 (the wrap)."""
    acts = [str(a) for a in interleaved_1f1b(2, 4, 2).for_stage(0)]
    assert acts[:4] == ["F0@s0", "F1@s0", "F0@s0.1", "F1@s0.1"]
    assert acts[4:8] == ["F2@s0", "B0@s0.1", "F3@s0", "B1@s0.1"]
    assert [a.virtual(2) for a in interleaved_1f1b(2, 4, 2).for_stage(1)][:2] == [1, 1]


def test_invalid_schedules_are_rejected():
    """Bad sizes, unknown names, missing actions and backward-before-forward raise ScheduleError; a schedule whose
    stages wait on each other forever is reported as a deadlock by the replay."""
    with pytest.raises(ScheduleError, match="micro_batches"):
        gpipe(2, 0)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        make_schedule("zigzag", 2, 2)
    with pytest.raises(ScheduleError, match="multiple of 4"):
        make_schedule("1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match="no interleaved form"):
        make_schedule("gpipe", 2, 4, 2)
    with pytest.raises(ScheduleError, match="at least 2 pipeline stages"):
        make_schedule("1f1b", 1, 4, 2)
    with pytest.raises(ScheduleError, match="virtual_stages must be >= 1"):
        make_schedule("1f1b", 2, 4, 0)
    with pytest.raises(ScheduleError, match="of chunks 0..1"):      # chunk 1 of micro-batch 0 missing
        PipelineSchedule("bad", 1, 1, ((Action(0, 0, "F"), Action(0, 0, "B")),), 2)
    with pytest.raises(ScheduleError, match="exactly once"):
        PipelineSchedule("bad", 1, 2, ((Action(0, 0, "F"), Action(0, 0, "B")),))
    with pytest.raises(ScheduleError, match="before F0"):
        PipelineSchedule("bad", 1, 1, ((Action(0, 0, "B"), Action(0, 0, "F")),))
    # legal per stage, but stage 0 waits for B0 from stage 1 while stage 1 waits for F1 from stage 0
    dead = PipelineSchedule("dead", 2, 2, (
        (Action(0, 0, "F"), Action(0, 0, "B"), Action(0, 1, "F"), Action(0, 1, "B")),
        (Action(1, 0, "F"), Action(1, 1, "F"), Action(1, 0, "B"), Action(1, 1, "B"))))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(dead)


def test_schedule_command_draws_picture(tmp_path, capsys):
    """`pslab schedule` writes a PNG and prints the bubble next to (p−1)/(m+p−1); bad sizes give exit code 1."""
    from pslab.experiments.cli import main
    out = tmp_path / "pipe.png"
    assert main(["schedule", "--stages", "4", "--micro-batches", "8", "--schedule", "1f1b", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "bubble=0.2727" in text and "peak in-flight per stage=[4, 3, 2, 1]" in text
    assert main(["schedule", "--stages", "0", "-o", str(tmp_path / "x.png")]) == 1


def test_schedule_command_draws_interleaved(tmp_path, capsys):
    """`pslab schedule -v 2` replays interleaved 1F1B next to (p−1)/(v·m+p−1); m not a multiple of p: exit 1."""
    from pslab.experiments.cli import main
    out = tmp_path / "inter.png"
    assert main(["schedule", "-p", "4", "-m", "8", "-v", "2", "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "interleaved-1f1b: p=4 m=8 v=2 bubble=0.1579 (theory (p-1)/(v*m+p-1)=0.1579)" in text
    assert "peak in-flight per stage=[11, 9, 7, 5] (chunk-micro-batches" in text
    assert main(["schedule", "-p", "4", "-m", "6", "-v", "2", "-o", str(out)]) == 1
    assert "multiple of 4" in capsys.readouterr().err


def test_schedule_command_run_measures(tmp_path, capsys):
    """`pslab schedule --run` executes the schedule on p processes and draws the measured timeline; it reports the
    measured peak in-flight activations of 1F1B (min(p−s, m) per stage)."""
    from pslab.experiments.cli import main
    out = tmp_path / "run.png"
    assert main(["schedule", "--stages", "2", "--micro-batches", "3", "--schedule", "1f1b", "--run",
                 "--forward-ms", "5", "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "measured bubble=" in text and "measured peak in-flight per stage=[2, 1]" in text
