"""The job's monitor on hand-made shared tables: step lines that add up, one per step,
the status.json training block, resource samples, the summary's stage accounting, and
the console's plain lines."""

import json
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_actors import console
from dflash_actors.config import Config, build
from dflash_actors.models.loss import BlockStats
from dflash_actors.observe.monitor import Monitor, accounting, progress_line, starting_line
from dflash_actors.observe.status import JobStatus
from dflash_actors.train.metrics import batch_table, step_table, write_batch, write_step
from dflash_actors.train.schedule import Schedule

STAGES = [SimpleNamespace(role=r, count=c) for r, c in (("loader", 1), ("target", 2), ("drafter", 2),
                                                         ("optimizer", 1))]


def config(tmp_path, **monitor):
    return build(Config, {"runtime": {"run_dir": str(tmp_path)},
                          "monitor": {"tensorboard": False, "resources_every_s": 1000.0, **monitor}})


def stats(correct: int) -> BlockStats:
    # 4 blocks of 4 slots; slot 0 is the anchor, which a DFlash never scores (a DSpark's
    # anchor slot proposes, and is scored: ``BlockStats.metrics`` tells them apart by it)
    return BlockStats(4, correct, torch.tensor([0, correct, 1, 0]), torch.tensor([0, 4, 4, 4]), 8.0, 2.0)


def job(tmp_path, steps=3):
    sched = Schedule(per_step=4, num_drafters=2, steps_per_epoch=(2, steps - 2))
    shared = SimpleNamespace(step_stats=step_table(steps), batch_stats=batch_table(4 * steps, 4),
                             weights=SimpleNamespace(version=0))
    work = torch.zeros(4 * steps, 4, dtype=torch.float64)
    work[:, 1] = 0.5        # every batch: target 0.5 s, drafter 1.0 s
    work[:, 2] = 1.0
    return sched, shared, work


def finish_step(shared, sched, s, t):
    for b in range(sched.first_of_step(s), sched.first_of_step(s + 1)):
        write_batch(shared.batch_stats, b, stats(2), 100)
    write_step(shared.step_stats, s, stats(2) + stats(2) + stats(2) + stats(2), 1e-3, 0.5, 400)
    shared.step_stats[s, 5] = t
    shared.weights.version = s + 1


def status(busy=0.0):
    return {"actors": {a: {"pid": 10 + i, "restarts": 0, "phase": None, "stuck": None, "busy_s": busy,
                           "rss_mb": 100.0, "cpu_pct": 5.0, "gpu_mem_mb": None}
                       for i, a in enumerate(["loader.0", "target.0", "target.1", "drafter.0", "drafter.1",
                                              "optimizer.0"])}}


def lines(tmp_path, kind):
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == kind]


def test_one_step_line_per_step_adding_up(tmp_path):
    sched, shared, work = job(tmp_path)
    m = Monitor(config(tmp_path), sched, shared, 0, enabled=False)
    hook = JobStatus(m)      # the job's on_status: what the supervisor calls
    m.watch(work, STAGES)
    st = status()
    hook(st)                                   # every actor ready: rates count from now
    t0 = m.t_train
    finish_step(shared, sched, 0, t0 + 2.0)
    finish_step(shared, sched, 1, t0 + 4.0)
    hook(st)
    hook(st)                                   # nothing new: nothing written twice
    finish_step(shared, sched, 2, t0 + 5.0)
    hook(st)
    m.close()
    steps = lines(tmp_path, "step")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["epoch"] for s in steps] == [1, 1, 2]
    assert [s["tokens_per_s"] for s in steps] == [200.0, 200.0, 400.0]
    assert steps[0]["slot_acc"] == [0.5, 0.25, 0.0]
    assert steps[0]["stages"]["drafter"] == {"busy_s": 4.0, "wait_s": 0.0}         # 2 drafters x 2 s
    assert steps[2]["stages"]["target"] == {"busy_s": 2.0, "wait_s": 0.0}
    assert steps[2]["stages"]["loader"] == {"busy_s": 0.0, "wait_s": 1.0}
    tr = st["training"]
    assert tr["step"] == 3 and tr["total_steps"] == 3 and tr["tokens"] == 1200 and tr["epoch"] == 2
    assert tr["total_epochs"] == 2 and tr["tokens_per_s"] == 240.0 and tr["skipped_steps"] == 0
    assert tr["loss"] == pytest.approx(4.0)


def test_a_step_done_before_the_monitor_saw_it_start_has_no_rate(tmp_path):
    sched, shared, work = job(tmp_path)
    m = Monitor(config(tmp_path), sched, shared, 0, enabled=False)
    hook = JobStatus(m)      # the job's on_status: what the supervisor calls
    m.watch(work, STAGES)
    finish_step(shared, sched, 0, 1.0)      # long before the first look
    hook(status())
    m.close()
    (step,) = lines(tmp_path, "step")
    assert step["tokens_per_s"] is None and step["stages"]["target"] == {"busy_s": 2.0, "wait_s": None}


def test_a_resumed_run_starts_its_lines_at_its_checkpoint(tmp_path):
    sched, shared, work = job(tmp_path)
    shared.weights.version = 2
    m = Monitor(config(tmp_path), sched, shared, 2, enabled=False)
    hook = JobStatus(m)      # the job's on_status: what the supervisor calls
    m.watch(work, STAGES)
    hook(status())
    finish_step(shared, sched, 2, m.t_train + 1.0)
    hook(status())
    m.close()
    assert [s["step"] for s in lines(tmp_path, "step")] == [3]


def test_resource_samples_give_busy_since_the_last_one(tmp_path):
    sched, shared, work = job(tmp_path)
    m = Monitor(config(tmp_path, resources_every_s=0.01), sched, shared, 0, enabled=False)
    hook = JobStatus(m)      # the job's on_status: what the supervisor calls
    m.watch(work, STAGES)
    hook(status(busy=1.0))
    m.last_sample = (m.last_sample[0] - 10.0, m.last_sample[1])     # as if 10 s ago
    hook(status(busy=6.0))
    m.close()
    samples = lines(tmp_path, "resources")
    assert len(samples) == 2 and samples[0]["actors"]["target.0"]["busy_pct"] is None
    assert samples[1]["actors"]["target.0"]["busy_pct"] == pytest.approx(50.0, abs=0.5)
    assert samples[1]["actors"]["target.0"]["rss_mb"] == 100.0
    assert samples[1]["host"]["mem_total_mb"] > 0


def test_stage_accounting_and_mfu(tmp_path):
    sched, shared, work = job(tmp_path)
    for s in range(3):
        finish_step(shared, sched, s, 100.0 + s)
    target = SimpleNamespace(num_attention_heads=4, hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                             head_dim=16, vocab_size=256)
    acct = accounting(config(tmp_path, peak_tflops=1e-3), target, [1, 3], sched, shared.step_stats,
                      shared.batch_stats, work, [(s.role, s.count) for s in STAGES], 0, 12.0, 2.0,
                      {"target": "cpu", "drafter": "cpu"})
    assert acct["target"]["busy_s"] == 6.0 and acct["drafter"]["busy_s"] == 12.0
    assert acct["drafter"]["busy_fraction"] == 0.5          # 12 s of 2 drafters x 12 s
    assert acct["drafter"]["tokens_per_s"] == 200.0          # 1200 tokens, 2 drafters, 6 s each
    assert acct["target"]["tflops"] > 0 and acct["target"]["mfu"] == pytest.approx(
        acct["target"]["tflops"] / 1e-3, rel=1e-2)
    assert "tflops" not in acct["loader"]


def test_console_lines_are_whole_and_stamped(capsys, monkeypatch):
    monkeypatch.setattr(console, "_mode", None)
    assert console.setup("auto", 0.0) == "lines"             # pytest's stdout is no terminal
    bar = console.progress(10, "open dataset", "shards")
    bar.t0 -= 2.0                                             # past the delay
    bar.next -= 2.0
    bar.update(4)
    bar.close()
    console.say("target.1 restarted")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("open dataset: 4/10 shards (40%), 2.0/s, eta 0:00:03")
    assert out[1].endswith("open dataset: 4/10 shards (40%), done in 2.0 s")
    assert out[2].endswith("] target.1 restarted") and all(x.startswith("[") for x in out)
    monkeypatch.setattr(console, "_mode", "off")
    console.say("nothing")
    assert capsys.readouterr().out == ""


def test_progress_and_starting_lines():
    t = {"step": 42, "total_steps": 160, "epoch": 10, "total_epochs": 40, "loss": 5.12345, "simulated_tau": 1.5,
         "lr": 3e-4, "tokens_per_s": 2800.0, "tokens_per_s_30s": 3012.4, "eta_s": 38.0, "skipped_steps": 1}
    assert progress_line(t, 2) == ("step 42/160 (26%) epoch 10/40 | loss 5.1235 tau 1.50 lr 3.0e-04 | 3012 tok/s "
                                   "| eta 0:00:38 | 2 restarts | 1 skipped steps")
    load = {"name": "load target weights", "done": None, "total": None, "elapsed_s": 4.4}
    st = {"actors": {"loader.0": {"phase": None},
                     "target.0": {"phase": {**load, "done": 3, "total": 12}},
                     "target.1": {"phase": {**load, "elapsed_s": 6.0}},
                     "drafter.0": {"phase": {**load, "name": "build drafter"}}}}
    assert starting_line(st, 1) == ("starting: 1/4 actors ready | load target weights: target.0 3/12, target.1 (6 s) "
                                    "| build drafter: drafter.0 (4 s)")


def test_tensorboard_scalars_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sched, shared, work = job(tmp_path)
    m = Monitor(config(tmp_path, tensorboard=True), sched, shared, 0, enabled=False)
    hook = JobStatus(m)      # the job's on_status: what the supervisor calls
    m.watch(work, STAGES)
    hook(status())
    for s in range(3):
        finish_step(shared, sched, s, m.t_train + s + 1)
    hook(status())
    m.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/loss")] == [(1, 4.0), (2, 4.0), (3, 4.0)]
    assert [e.value for e in acc.Scalars("perf/busy_s/drafter")] == [4.0, 4.0, 4.0]
    assert "train/slot_acc/3" in acc.Tags()["scalars"]


def test_a_phase_without_counts_says_it_goes_on_then_that_it_is_done(capsys, monkeypatch):
    monkeypatch.setattr(console, "_mode", "lines")
    monkeypatch.setattr(console, "_every_s", 0.05)
    monkeypatch.setattr(console, "DELAY_S", 0.05)
    with console.phase("build drafter"):
        time.sleep(0.3)
    with console.phase("quick"):
        pass
    out = capsys.readouterr().out.splitlines()
    assert len(out) >= 3 and all(x.endswith(" s so far") and "] build drafter: " in x for x in out[:-1])
    assert "] build drafter: done in 0.3 s" in out[-1]
