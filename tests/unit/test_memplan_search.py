"""The memory plan's search on made-up traces: which micro-batch, checkpointing and
placement it picks for devices of chosen sizes, and the line it gives when nothing fits.
(``test_memplan.py`` checks the traces themselves against real steps.)"""

from transformers import Qwen3Config

from dflash_actors.config import load_config
from dflash_actors.train import memplan
from dflash_actors.train.memtrace import StepTrace
from tests.support.pipeline import ROOT

MIB, GIB = 2 ** 20, memplan.GIB
B = 4
SHAPE = memplan.BatchShape(rows=8, length=256, anchors=64, target_rows=8, target_length=256, longest=256)
WHOLE, ROW = 8 * 64 * B, 64 * B
"""The batch's block tokens, and one sequence's."""
TARGET = Qwen3Config(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     num_hidden_layers=6, vocab_size=1000, max_position_embeddings=4096)


class FakeTraces:
    """A drafter step of 1 MiB per block token (a quarter of it with checkpointed layers),
    a target of 2 GiB in bf16, and each trace counted."""

    def __init__(self):
        self.calls = 0

    def step(self, device_type, rows, ctx, anchors, ckpt):
        self.calls += 1
        peak = rows * anchors * B * MIB // (4 if ckpt else 1)
        return StepTrace(peak // 2, peak)

    def forward(self, device_type, rows, length):
        return StepTrace(0, rows * length * 4096)

    def optimizer(self, device_type):
        return StepTrace(0, 3 * 4 * self.drafter_numel())

    def target_numel(self):
        return GIB

    def drafter_numel(self):
        return 8 * MIB


def plan(gpus: dict, **changes):
    cfg = load_config(ROOT / "configs/default.yaml", [("drafter.block_size", B), *changes.items()], topology="1-1")
    inp = memplan.Inputs(cfg, ("cuda:0",), ("cuda:1",), ("cpu",), TARGET, [1, 3], SHAPE, {"cpu": 512 * GIB, **gpus})
    return memplan.make_plan(inp, FakeTraces())


def device(p, name):
    return next(d for d in p.devices if d.device == name)


def parts(p, name, process):
    return sum(x.nbytes for x in device(p, name).parts if x.process == process)


def sized(need: int) -> int:
    """A GPU whose usable memory is exactly ``need``."""
    return int(need / (1 - memplan.HEADROOM)) + 1


ROOMY = {"cuda:0": 64 * GIB, "cuda:1": 64 * GIB}


def drafter_fixed(**changes) -> int:
    """Everything on the drafter's GPU but its step."""
    p = plan(ROOMY, **changes)
    d = device(p, "cuda:1")
    return d.need - sum(x.nbytes for x in d.parts if x.key == "train.drafter_block_tokens")


def test_the_whole_batch_when_it_fits():
    p = plan(ROOMY)
    assert p.drafter_block_tokens is None and not p.checkpoint_layers and p.problem is None and p.settings == {}


def test_micro_batches_when_only_they_fit():
    """Room for 1000 block tokens: the largest power-of-two multiple of the block below it."""
    p = plan({"cuda:0": 64 * GIB, "cuda:1": sized(drafter_fixed() + 1000 * MIB)})
    assert (p.drafter_block_tokens, p.checkpoint_layers, p.problem) == (512, False, None)
    assert p.settings == {"train.drafter_block_tokens": 512}


def test_checkpointing_when_not_one_sequence_fits():
    """Room for 200 MiB: a sequence's 256 block tokens need 256 MiB, a quarter with checkpointing."""
    p = plan({"cuda:0": 64 * GIB, "cuda:1": sized(drafter_fixed() + 200 * MIB)})
    assert (p.drafter_block_tokens, p.checkpoint_layers, p.problem) == (512, True, None)
    assert p.settings == {"train.drafter_block_tokens": 512, "train.checkpoint_layers": "on"}
    # Checkpointing kept off: micro-batches below one sequence (cut into runs of its anchors).
    off = plan({"cuda:0": 64 * GIB, "cuda:1": sized(drafter_fixed() + 200 * MIB)}, **{"train.checkpoint_layers": "off"})
    assert (off.drafter_block_tokens, off.checkpoint_layers, off.problem) == (128, False, None)


def test_nothing_fits_is_one_line_naming_a_key():
    p = plan({"cuda:0": 64 * GIB, "cuda:1": sized(drafter_fixed() // 2)})
    assert p.problem.startswith("memory plan: cuda:1 needs") and "change " in p.problem and "\n" not in p.problem
    assert (p.drafter_block_tokens, p.checkpoint_layers) == (B, True)      # the smallest, shown


def test_the_evaluator_goes_where_there_is_room():
    """eval.device auto: a target's GPU with room for a whole second target; else the
    drafter's, if that costs its step nothing; else the host."""
    roomy = plan(ROOMY, **{"eval.every": 1})
    assert roomy.eval_device == "cuda:0" and roomy.settings == {"eval.device": "cuda:0"}
    evaluator = parts(roomy, "cuda:0", "evaluator")
    target_gpu = sized(device(roomy, "cuda:0").need - evaluator)
    drafter = plan({"cuda:0": target_gpu, "cuda:1": 64 * GIB}, **{"eval.every": 1})
    assert drafter.eval_device == "cuda:1" and drafter.drafter_block_tokens is None and drafter.problem is None
    host = plan({"cuda:0": target_gpu, "cuda:1": sized(drafter_fixed() + WHOLE * MIB)}, **{"eval.every": 1})
    assert host.eval_device == "cpu" and host.settings == {"eval.device": "cpu"}
    assert host.drafter_block_tokens is None and host.problem is None


def test_a_device_over_elsewhere_leaves_the_drafters_step_alone():
    """The evaluator set on the target's full GPU: the line names eval.device, and the
    drafters keep the step their own GPU holds, not the smallest."""
    roomy = plan(ROOMY, **{"eval.every": 1})
    target_gpu = sized(device(roomy, "cuda:0").need - parts(roomy, "cuda:0", "evaluator"))
    p = plan({"cuda:0": target_gpu, "cuda:1": 64 * GIB}, **{"eval.every": 1, "eval.device": "cuda:0"})
    assert p.problem.startswith("memory plan: cuda:0 needs")
    assert "evaluator" in p.problem and "change eval.device (auto lets the plan place it" in p.problem
    assert p.drafter_block_tokens is None and not p.checkpoint_layers and p.settings == {}


def test_a_part_the_plan_placed_is_not_offered_to_move():
    """With eval.device auto nothing fits a target too big for its GPU; moving the
    evaluator would not help, and the line says what would."""
    p = plan({"cuda:0": sized(GIB), "cuda:1": 64 * GIB}, **{"eval.every": 1})
    assert p.problem.startswith("memory plan: cuda:0 needs") and "eval.device" not in p.problem
    assert "change topology.target_tp" in p.problem


def test_a_context_moves_with_its_process():
    p = plan(ROOMY, **{"eval.every": 1, "eval.device": "cuda:0", "runtime.optimizer_device": "cuda:0"})
    keys = {x.process: x.key for x in device(p, "cuda:0").parts if x.what == "CUDA context"}
    assert keys == {"evaluator": "eval.device", "optimizer.0": "runtime.optimizer_device", "target.0": "topology"}


def test_every_placement_left_to_the_plan_is_tried():
    def placements(**changes):
        cfg = load_config(ROOT / "configs/default.yaml", list(changes.items()), topology="1-1")
        inp = memplan.Inputs(cfg, ("cuda:0",), ("cuda:1",), ("cpu", "cuda:1"), TARGET, [1, 3], SHAPE, {})
        return {(p.optimizer, p.ring, p.evaluator) for p in memplan.placements(inp)}
    anywhere = ("cuda:0", "cuda:1", "cpu")
    rings = ("cpu", "cuda:1")
    assert placements(**{"eval.every": 1}) == {(o, r, e) for o in anywhere for r in rings for e in anywhere}
    assert placements() == {(o, r, None) for o in anywhere for r in rings}
    assert placements(**{"eval.every": 1, "eval.device": "cpu", "runtime.optimizer_device": "cuda:1"}) == \
        {("cuda:1", r, "cpu") for r in rings}
