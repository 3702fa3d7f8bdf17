"""The bad-input corpus: every case exits 2 with exactly one line on stderr, starting
``error: ``, that names the file or the config key (and the row or value where there is
one), before anything spawns; the run directory is not written and no input file is
changed. ``test_launch_errors`` holds the first cases; these are the rest."""

import contextlib
import hashlib
import json
import os
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pytest
import torch

import launch
from dflash_actors.config import dump_config, load_config
from dflash_actors.data.synthetic import flatten, write_token_dataset
from dflash_actors.job import rundir
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.head import load_head
from dflash_actors.train.checkpoint import save_checkpoint
from tests.support.pipeline import ROOT, SMALL

IDS = [np.arange(2, 40), np.arange(5, 35), np.arange(7, 47)]   # 38, 30 and 40 tokens


def ids_table(ids=IDS, masks=None) -> pa.Table:
    cols = {"input_ids": pa.array([list(map(int, s)) for s in ids], pa.list_(pa.int32()))}
    if masks is not None:
        cols["loss_mask"] = pa.array([list(map(int, m)) for m in masks], pa.list_(pa.int8()))
    return pa.table(cols)


def stream_bytes(t: pa.Table, rows_per_batch: int = 1) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        for b in t.to_batches(max_chunksize=rows_per_batch):
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def dataset_dir(path, ids, masks=None, **kw):
    offsets, flat = flatten([np.asarray(s) for s in ids])
    return write_token_dataset(path, offsets, flat, None if masks is None else flatten(
        [np.asarray(m, np.int8) for m in masks])[1], **kw)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Every bad file of the corpus, keyed by the placeholder the cases use."""
    d = tmp_path_factory.mktemp("bad-inputs")
    ones = [np.ones(len(s), np.int8) for s in IDS]
    good = stream_bytes(ids_table(masks=ones))
    (d / "truncated.arrow").write_bytes(good[:len(good) // 2])
    # Cut exactly after the first record batch: pyarrow reads the rest as a whole stream.
    src = pa.BufferReader(good)
    reader = pa.ipc.open_stream(src)
    reader.read_next_batch()
    (d / "cut.arrow").write_bytes(good[:src.tell()])
    (d / "random.arrow").write_bytes(np.random.default_rng(0).bytes(4096))
    (d / "random.parquet").write_bytes(np.random.default_rng(1).bytes(4096))
    (d / "tokens.txt").write_text("1 2 3\n")
    (d / "no_ids.arrow").write_bytes(stream_bytes(pa.table({"tokens": pa.array([[1, 2, 3]])})))
    (d / "scalar_ids.arrow").write_bytes(stream_bytes(pa.table({"input_ids": pa.array([3, 4, 5], pa.int64())})))
    (d / "float_ids.arrow").write_bytes(stream_bytes(pa.table({"input_ids": pa.array([[2.0, 3.5, 4.0]])})))
    (d / "null_row.arrow").write_bytes(stream_bytes(pa.table(
        {"input_ids": pa.array([[2, 3, 4], None, [5, 6]], pa.list_(pa.int32()))})))
    (d / "seq_len.arrow").write_bytes(stream_bytes(pa.table(
        {"input_ids": ids_table().column("input_ids"), "seq_len": pa.array([38, 31, 40], pa.int64())})))
    short = [m.copy() for m in ones]
    short[2] = short[2][:-1]
    (d / "mask_len.arrow").write_bytes(stream_bytes(ids_table(masks=short)))
    dataset_dir(d / "empty_sample", [IDS[0], np.zeros(0, np.int64), IDS[2]])
    dataset_dir(d / "negative", [IDS[0], np.array([4, -5, 6]), IDS[2]], [ones[0], np.ones(3), ones[2]])
    two = [m.copy() for m in ones]
    two[1][3] = 2
    dataset_dir(d / "mask_two", IDS, two)
    (d / "empty_ds.arrow").write_bytes(stream_bytes(ids_table(ids=[], masks=[])))
    dataset_dir(d / "zero_mask", IDS, [np.zeros(len(s), np.int8) for s in IDS])
    # Supervised tokens, but never two in a row: still no anchor.
    dataset_dir(d / "alternating", IDS, [np.arange(len(s)) % 2 for s in IDS])
    # Supervised only from token 10 on: nothing left once samples are cut to 8 tokens.
    dataset_dir(d / "late_mask", IDS, [np.arange(len(s)) >= 10 for s in IDS])
    dataset_dir(d / "one_token", [np.array([5]), np.array([9]), np.array([7])], [np.ones(1)] * 3)
    (d / "one_token_no_mask.arrow").write_bytes(stream_bytes(ids_table(ids=[[5], [9], [7]])))
    missing = dataset_dir(d / "missing_shard", IDS, ones, num_shards=2)
    (missing / "data-00001-of-00002.arrow").unlink()
    bad_state = dataset_dir(d / "bad_state", IDS, ones)
    (bad_state / "state.json").write_text("{not json")
    (d / "no_files").mkdir()
    (d / "no_files" / "README.md").write_text("the data went elsewhere\n")
    (d / "mixed").mkdir()
    (d / "mixed" / "a.arrow").write_bytes(stream_bytes(ids_table(masks=ones)))
    (d / "mixed" / "b.arrow").write_bytes(stream_bytes(ids_table()))
    yaml_files = {
        "syntax_yaml": "train: {lr: [\n",
        "unknown_yaml": "train:\n  learning_rate: 0.1\n",
        "type_yaml": "train:\n  grad_accum: two\n",
        "section_yaml": "batching: 5\n",
        "list_yaml": "- train\n- data\n",
        "empty_yaml": "",
        "comments_yaml": "# nothing set here\n",
        "nan_yaml": "train:\n  weight_decay: .nan\n",
        "empty_path_yaml": "data:\n  path: ''\n",
    }
    for name, text in yaml_files.items():
        (d / f"{name}.yaml").write_text(text)
    (d / "binary_yaml.yaml").write_bytes(b"\xff\xfe\x00\x81" + np.random.default_rng(2).bytes(256))
    # Targets: a random one over the synthetic data's 256 ids, so that no case waits for
    # the tiny target's fit, and one whose vocabulary is smaller than the data's ids.
    from transformers import Qwen3Config, Qwen3ForCausalLM
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=256, **shape)).save_pretrained(d / "target")
    Qwen3Config(vocab_size=64, **shape).save_pretrained(d / "small_vocab")
    return d


CASES = {
    # dataset files
    "truncated arrow": (["--set", "data.path={d}/truncated.arrow"], ["{d}/truncated.arrow", "cut short"]),
    "arrow cut at a batch boundary": (["--set", "data.path={d}/cut.arrow"],
                                      ["{d}/cut.arrow", "cut short after 1 rows"]),
    "random-bytes arrow": (["--set", "data.path={d}/random.arrow"], ["{d}/random.arrow", "not an Arrow IPC"]),
    "random-bytes parquet": (["--set", "data.path={d}/random.parquet"],
                             ["{d}/random.parquet", "not a readable parquet"]),
    "not a data file": (["--set", "data.path={d}/tokens.txt"], ["{d}/tokens.txt", "expected a save_to_disk"]),
    "missing input_ids": (["--set", "data.path={d}/no_ids.arrow"], ["{d}/no_ids.arrow", "missing column 'input_ids'"]),
    "non-list column": (["--set", "data.path={d}/scalar_ids.arrow"],
                        ["{d}/scalar_ids.arrow", "'input_ids' must be a list of integers (got int64)"]),
    "float token ids": (["--set", "data.path={d}/float_ids.arrow"],
                        ["{d}/float_ids.arrow", "must hold integers (got list<double>)"]),
    "null sample": (["--set", "data.path={d}/null_row.arrow"], ["{d}/null_row.arrow", "row 1: input_ids is null"]),
    "seq_len disagrees": (["--set", "data.path={d}/seq_len.arrow"],
                          ["{d}/seq_len.arrow", "row 1: seq_len says 31 but input_ids has 30"]),
    "loss_mask length": (["--set", "data.path={d}/mask_len.arrow"],
                         ["{d}/mask_len.arrow", "row 2: input_ids has 40 tokens but loss_mask has 39"]),
    "empty sample": (["--set", "data.path={d}/empty_sample"], ["data-00000-of-00001.arrow", "row 1: empty sample"]),
    "negative token id": (["--set", "data.path={d}/negative"],
                          ["{d}/negative/data-00000-of-00001.arrow", "row 1: input_ids value -5 outside [0, "]),
    "loss_mask not 0 or 1": (["--set", "data.path={d}/mask_two"],
                             ["{d}/mask_two/data-00000-of-00001.arrow", "row 1: loss_mask value 2 not 0 or 1"]),
    "empty dataset": (["--set", "data.path={d}/empty_ds.arrow"], ["{d}/empty_ds.arrow", "has no samples"]),
    "all-zero loss masks": (["--set", "data.path={d}/zero_mask"],
                            ["{d}/zero_mask", "nothing to learn", "2 consecutive loss_mask=1"]),
    "no two supervised tokens in a row": (["--set", "data.path={d}/alternating"],
                                          ["{d}/alternating", "nothing to learn"]),
    "one-token samples": (["--set", "data.path={d}/one_token"], ["{d}/one_token", "nothing to learn"]),
    "one-token samples, no loss_mask": (["--set", "data.path={d}/one_token_no_mask.arrow"],
                                        ["{d}/one_token_no_mask.arrow", "nothing to learn: every sample is 1 token"]),
    "anchors only past max_seq_len": (["--set", "data.path={d}/late_mask", "--set", "data.max_seq_len=8"],
                                      ["{d}/late_mask", "nothing to learn"]),
    "every sample dropped": (["--set", "data.path={d}/mixed/a.arrow", "--set", "data.max_seq_len=16",
                              "--set", "data.overlong=drop"],
                             ["{d}/mixed/a.arrow", "every sample is longer than max_seq_len=16"]),
    "state.json names a missing shard": (["--set", "data.path={d}/missing_shard"],
                                         ["{d}/missing_shard/data-00001-of-00002.arrow",
                                          "listed in state.json but missing"]),
    "unreadable state.json": (["--set", "data.path={d}/bad_state"],
                              ["{d}/bad_state/state.json", "unreadable save_to_disk state"]),
    "directory without data files": (["--set", "data.path={d}/no_files"],
                                     ["{d}/no_files", "no .arrow or .parquet shards"]),
    "loss_mask in some shards only": (["--set", "data.path={d}/mixed"],
                                      ["{d}/mixed/b.arrow", "loss_mask present in some shards but not others"]),
    "--set data.path= (empty)": (["--set", "data.path="], ["data.path", "empty value"]),
    "--set data.path='' (empty string)": (["--set", "data.path=''"], ["data.path", "must not be empty"]),
    "data.path '' in YAML": (["--config", "{d}/empty_path_yaml.yaml"], ["data.path", "must not be empty"]),
    # the YAML config file
    "YAML syntax error": (["--config", "{d}/syntax_yaml.yaml"], ["{d}/syntax_yaml.yaml", "not valid YAML"]),
    "unknown key in YAML": (["--config", "{d}/unknown_yaml.yaml"], ["train.learning_rate: unknown key"]),
    "wrong type in YAML": (["--config", "{d}/type_yaml.yaml"], ["train.grad_accum: must be int (got 'two')"]),
    "section given a value": (["--config", "{d}/section_yaml.yaml"], ["batching: must be a mapping (got 5)"]),
    "top level not a mapping": (["--config", "{d}/list_yaml.yaml"], ["{d}/list_yaml.yaml", "mapping at top level"]),
    "empty config file": (["--config", "{d}/empty_yaml.yaml"], ["{d}/empty_yaml.yaml", "is empty"]),
    "config of comments only": (["--config", "{d}/comments_yaml.yaml"], ["{d}/comments_yaml.yaml", "is empty"]),
    "binary config file": (["--config", "{d}/binary_yaml.yaml"], ["{d}/binary_yaml.yaml", "not UTF-8"]),
    "missing config file": (["--config", "{d}/nowhere.yaml"], ["{d}/nowhere.yaml", "file not found"]),
    # numbers that are not finite
    "lr infinite": (["--set", "train.lr=.inf"], ["train.lr: must be a finite number (got inf)"]),
    "lr NaN": (["--set", "train.lr=.nan"], ["train.lr: must be a finite number (got nan)"]),
    "lr 'inf' as text": (["--set", "train.lr=inf"], ["train.lr: must be a finite number (got inf)"]),
    "hang timeout infinite": (["--set", "runtime.hang_timeout_s=.inf"], ["runtime.hang_timeout_s", "(got inf)"]),
    "gamma infinite (an optional float)": (["--set", "train.gamma=.inf"],
                                           ["train.gamma: must be a finite number (got inf)"]),
    "simulated tflops infinite": (["--set", "runtime.simulate.tflops=.inf"], ["runtime.simulate.tflops", "(got inf)"]),
    "NaN in YAML": (["--config", "{d}/nan_yaml.yaml"], ["train.weight_decay: must be a finite number (got nan)"]),
    "negative Muon lr": (["--set", "train.optimizer=muon", "--set", "train.muon_lr=-0.001"],
                         ["train.muon_lr: must be > 0 (got -0.001)"]),
    "unknown optimizer": (["--set", "train.optimizer=sgd"], ["train.optimizer: must be one of ['adamw', 'muon']"]),
    # run setup and target
    "more drafter GPUs than exist": (["--set", "topology.drafter_devices=[cuda:{cuda}]"],
                                     ["topology.drafter_devices", "cuda:{cuda}"]),
    "--run-dir and --resume differ": (["--resume", "{d}/elsewhere"], ["--run-dir and --resume"]),
    "missing target directory": (["--set", "target.path={d}/no_target"], ["target.path", "{d}/no_target"]),
    "missing drafter.init_from": (["--set", "drafter.init_from={d}/no_drafter"],
                                  ["drafter.init_from: {d}/no_drafter does not exist"]),
    "drafter.init_from not a drafter": (["--set", "drafter.init_from={d}/no_files"],
                                        ["drafter.init_from: {d}/no_files: not a drafter directory"]),
    "empty target path": (["--set", "target.path=''"], ["target.path", "must not be empty"]),
    "target vocabulary smaller than the data": (["--set", "target.path={d}/small_vocab"],
                                                ["data-00000-of-00001.arrow: row ", "outside [0, 64)"]),
    # DFlash2's sizes against the target, and its head
    "dflash2 group not dividing the hidden size": (["--set", "drafter.arch=dflash2",
                                                    "--set", "drafter.conv_group_size=7"],
                                                   ["drafter.conv_group_size: 7 must divide the hidden size"]),
    "dflash2 more candidates than tokens": (["--set", "drafter.arch=dflash2", "--set", "drafter.selector_top_k=10000"],
                                            ["drafter.selector_top_k: must be in 1..", "(got 10000)"]),
    "dflash2 over the data's head rows": (["--set", "drafter.arch=dflash2", "--set", "train.head_vocab=data"],
                                          ["train.head_vocab: dflash2 needs full"]),
    # DSpark's objective against the other sections, and its own keys
    "dspark without the target's distribution": (["--set", "drafter.arch=dspark"],
                                                 ["train.loss: dspark's distance and confidence terms"]),
    "dspark over the data's head rows": (["--set", "drafter.arch=dspark", "--set", "train.loss=distill",
                                          "--set", "train.head_vocab=data"], ["train.head_vocab: dspark needs full"]),
    "dspark with D-PACE weights": (["--set", "drafter.arch=dspark", "--set", "train.loss=distill",
                                    "--set", "train.position_weight=dpace"], ["train.position_weight: dspark"]),
    "dspark with every loss weight 0": (["--set", "drafter.arch=dspark", "--set", "drafter.dspark_ce_alpha=0",
                                         "--set", "drafter.dspark_distance_alpha=0",
                                         "--set", "drafter.dspark_confidence_alpha=0"],
                                        ["drafter.dspark_ce_alpha", "all 0"]),
    "dspark Markov rank 0": (["--set", "drafter.markov_rank=0"], ["drafter.markov_rank", "(got 0)"]),
    "dspark unknown distance": (["--set", "drafter.dspark_distance=js"], ["drafter.dspark_distance"]),
    "dspark negative loss weight": (["--set", "drafter.dspark_confidence_alpha=-1"],
                                    ["drafter.dspark_confidence_alpha", "(got -1"]),
    "xpress without the target's distribution": (["--set", "drafter.arch=xpress"],
                                                 ["train.loss: xpress's TV term"]),
    "xpress with D-PACE weights": (["--set", "drafter.arch=xpress", "--set", "train.loss=distill",
                                    "--set", "train.position_weight=dpace"], ["train.position_weight: xpress"]),
    "xpress unknown CE labels": (["--set", "drafter.xpress_ce_labels=argmax"], ["drafter.xpress_ce_labels"]),
    "--plan-only checks the target too": (["--plan-only", "--set", "target.path={d}/small_vocab"],
                                          ["data-00000-of-00001.arrow: row ", "outside [0, 64)"]),
    # sliding-window drafter layers, and shapes apart from the target's
    "window as long as the context": (["--set", "drafter.sliding_window=256"],
                                      ["drafter.sliding_window: must be < data.max_seq_len=256", "got 256"]),
    "window smaller than a block": (["--set", "drafter.sliding_window=4"],
                                    ["drafter.sliding_window: must be >= drafter.block_size=8"]),
    "layer_types of the wrong length": (["--set", "drafter.layer_types=[full_attention, full_attention]"],
                                        ["drafter.layer_types: names 2 layers, drafter.num_layers is 1"]),
    "a layer type the drafter lacks": (["--set", "drafter.layer_types=[linear_attention]"],
                                       ["drafter.layer_types[0]: must be one of"]),
    "init_from's layer types contradicted": (["--set", "drafter.init_from={d}/sliding_drafter",
                                              "--set", "drafter.layer_types=[full_attention]"],
                                             ["drafter.layer_types: {d}/sliding_drafter has ['sliding_attention'], "
                                              "this config states ['full_attention']"]),
    "init_from's window contradicted": (["--set", "drafter.init_from={d}/sliding_drafter",
                                         "--set", "drafter.sliding_window=32"],
                                        ["drafter.sliding_window: {d}/sliding_drafter has 16, this config states 32"]),
    "target layers copied into other heads": (["--set", "drafter.num_attention_heads=4",
                                               "--set", "drafter.num_key_value_heads=2"],
                                              ["drafter.init_parts: copying the target's layers needs"]),
}


def snapshot(root) -> dict:
    """Every file under ``root`` with a digest of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def launch_bad(argv: list[str], inputs, cache_dir, capsys) -> str:
    """Run launch in-process on the small config, the random target and ``argv`` (last,
    so that it wins); assert exit 2 and one ``error: `` line, and return it."""
    common = []
    for kv in SMALL + [f"data.cache_dir={cache_dir}", f"target.path={inputs}/target"]:
        common += ["--set", kv]
    assert launch.main(common + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def sliding_drafter(inputs, cache_dir):
    """``{d}/sliding_drafter``: a drafter for the random target whose one layer has a
    window of 16."""
    cfg = load_config(ROOT / "configs/default.yaml", SMALL + [
        f"data.cache_dir={cache_dir}", f"target.path={inputs}/target", "drafter.sliding_window=16"])
    build_drafter(cfg, load_head(cfg)).save_pretrained(inputs / "sliding_drafter")


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_names_it_and_writes_nothing(case, inputs, sliding_drafter, cache_dir, tmp_path, capsys):
    argv, expected = CASES[case]
    values = {"d": inputs, "cuda": max(3, torch.cuda.device_count())}
    argv = [a.format(**values) for a in argv]
    run_dir = tmp_path / "run"
    before = snapshot(inputs)
    line = launch_bad(["--run-dir", str(run_dir), *argv], inputs, cache_dir, capsys)
    for text in expected:
        assert text.format(**values) in line, line
    assert not run_dir.exists()
    assert snapshot(inputs) == before


@pytest.fixture(scope="module")
def resumable(inputs, cache_dir, tmp_path_factory):
    """A run directory as a job with ``train.lr=0.01`` leaves it: its config.yaml and a
    checkpoint (a real drafter, the trainer state naming that config)."""
    run_dir = tmp_path_factory.mktemp("resumable") / "run"
    saved = load_config(ROOT / "configs/default.yaml", SMALL + [
        f"data.cache_dir={cache_dir}", f"target.path={inputs}/target", f"runtime.run_dir={run_dir}", "train.lr=0.01"])
    drafter = build_drafter(saved, load_head(saved))
    save_checkpoint(run_dir, 1, drafter.save_pretrained,
                    {"step": 1, "config": saved.to_dict(), "optimizer": None})
    (run_dir / "config.yaml").write_text(dump_config(saved))
    return run_dir


def test_resume_that_changes_the_math_is_refused(resumable, inputs, cache_dir, capsys):
    before = snapshot(resumable)
    line = launch_bad(["--resume", str(resumable), "--set", "train.lr=0.002"], inputs, cache_dir, capsys)
    assert "resume refused" in line and "train.lr: 0.01 -> 0.002" in line, line
    after = snapshot(resumable)
    # The run-directory lock (rundir.RunDirLock) is the one file a refused job may leave.
    after.pop(".lock", None)
    assert after == before


def entries(root) -> dict:
    """Every entry under ``root``, symlinks and directories included, with what it is."""
    return {str(p.relative_to(root)): ("link", os.readlink(p)) if p.is_symlink() else
            ("dir",) if p.is_dir() else ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*"))}


@contextlib.contextmanager
def unwritable(path):
    """``path``, a file, refusing writes: no write permission, or for root (whom
    permissions do not stop) the immutable attribute."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        yield "Permission denied"
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root without chattr +i: no way to make a file unwritable")
    try:
        yield "Operation not permitted"
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


REFUSED = [("events.log", "directory"), ("events.log", "dangling symlink"), ("events.log", "unwritable file"),
           ("metrics.jsonl", "directory"), ("metrics.jsonl", "dangling symlink"), ("metrics.jsonl", "unwritable file"),
           ("status.json", "directory")]


@pytest.mark.parametrize("name,kind", REFUSED)
def test_a_run_file_that_cannot_be_written_exits_2_writing_nothing(name, kind, inputs, cache_dir, tmp_path, capsys):
    """A run directory (of a job stopped before its first checkpoint: --run-dir takes it)
    in which a file the job writes while it runs is in the way. status.json is replaced
    by a rename, which only a directory at its path stops."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    f = run_dir / name
    with contextlib.ExitStack() as stack:
        if kind == "directory":
            f.mkdir()
            why = "a directory"
        elif kind == "dangling symlink":
            f.symlink_to(tmp_path / "gone" / name)
            why = f"a symlink to {tmp_path / 'gone' / name}, in a directory that does not exist"
        else:
            f.write_text("{}\n")
            why = stack.enter_context(unwritable(f))
        before = entries(run_dir)
        line = launch_bad(["--run-dir", str(run_dir)], inputs, cache_dir, capsys)
        assert line == (f"error: runtime.run_dir: cannot write {f} ({why}); "
                        "move it away, or choose another --run-dir"), line
        assert entries(run_dir) == before
    assert not (tmp_path / "gone").exists()


def test_run_files_a_rename_or_an_append_can_write_are_accepted(tmp_path):
    """The check refuses only what would fail: a dangling status.json (the rename
    replaces the link), an events.log linking into an existing directory (the first
    append creates the file there). Checking creates nothing."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "status.json").symlink_to(tmp_path / "gone" / "status.json")
    (tmp_path / "events.log").symlink_to(tmp_path / "elsewhere" / "events.log")
    (tmp_path / "metrics.jsonl").write_text("")
    rundir.check(tmp_path)
    assert not (tmp_path / "gone").exists() and list((tmp_path / "elsewhere").iterdir()) == []


def test_resume_of_a_run_whose_events_log_is_a_directory_exits_2(resumable, inputs, cache_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(resumable, run_dir)
    (run_dir / "events.log").mkdir()
    before = entries(run_dir)
    line = launch_bad(["--resume", str(run_dir)], inputs, cache_dir, capsys)
    assert line.startswith(f"error: runtime.run_dir: cannot write {run_dir / 'events.log'} (a directory)"), line
    assert entries(run_dir) == before


def test_corpus_is_not_vacuous(inputs):
    """The files are what the cases say: pyarrow itself reads the cut stream without
    error (only our end-of-stream check catches it), and the small-vocabulary target
    really is one."""
    cut = pa.ipc.open_stream(pa.BufferReader((inputs / "cut.arrow").read_bytes())).read_all()
    assert cut.num_rows == 1
    assert json.loads((inputs / "small_vocab" / "config.json").read_text())["vocab_size"] == 64
