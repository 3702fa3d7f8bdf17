"""The human-readable table of a ``make bench`` run (also written as Markdown)."""

from __future__ import annotations


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells[1:]]


def _pipeline(p: dict) -> list[str]:
    sim = p["simulated"]
    out = [f"## Pipeline under simulated compute ({sim['target_us_per_token']:g} us/token target, "
           f"{sim['drafter_us_per_token']:g} us/token drafter, {sim['feature_width']} fp32 features/token, "
           f"{sim['tokens_per_batch']:.0f} tokens/batch, grad_accum 1)", ""]
    out += _table(["topology", "pipelined tok/s", "lockstep tok/s", "bound tok/s", "efficiency", "speedup",
                   "ideal speedup", "overhead ms/batch", "bottleneck", "stage ms (load/target/draft/opt-step)"],
                  [[r["topology"], f"{r['pipelined_tokens_per_s']:.0f}", f"{r['lockstep_tokens_per_s']:.0f}",
                    f"{r['bound_tokens_per_s']:.0f}", r["efficiency"], r["speedup"], r["ideal_speedup"],
                    r["overhead_ms_per_batch"], r["bottleneck"], "/".join(str(v) for v in r["stage_ms"].values())]
                   for r in p["pipeline"]])
    g = p["goals_met"]
    out += ["", f"Goals: efficiency >= 0.95 at every topology: {'met' if g['efficiency'] else 'MISSED'}; "
                f"speedup >= 0.95 x ideal: {'met' if g['speedup'] else 'MISSED'}. The bound is the slowest "
                "stage at the costs measured in the pipelined trace (the drafter stage includes the optimizer "
                "step it waits for); efficiency = pipelined / bound.", "",
            "### Busy fraction per stage (pipelined / lock-step), from the traces", ""]
    stages = list(p["pipeline"][0]["busy"])
    out += _table(["topology", *stages],
                  [[r["topology"], *(f"{r['busy'][s]['pipelined']:.2f} / {r['busy'][s]['lockstep']:.2f}"
                                     for s in stages)] for r in p["pipeline"]])
    out += ["", "### Bubbles in the pipelined runs: median idle gap (ms) between two work items of one actor, "
                "and the step's chain (ms): last gradient -> optimizer starts / optimizer commits -> next "
                "drafter batch starts", ""]
    out += _table(["topology", *stages, "drafter -> optimizer", "optimizer -> drafter"],
                  [[r["topology"], *(r["gap_ms"].get(s) for s in stages), r["chain_ms"]["drafter_to_optimizer"],
                    r["chain_ms"]["optimizer_to_drafter"]] for r in p["pipeline"]])
    b = p["bytes"]
    out += ["", f"### Bytes copied per batch in these runs (at the measured {b['copy_gb_per_s']} GB/s memcpy)", ""]
    out += _table(["buffer", "bytes", "ms"], [[k, f"{v['bytes']:,}", v["ms"]] for k, v in b["per_batch"].items()])
    return out


def _projection(projections: list[dict]) -> list[str]:
    out = ["", "## Projection at real sizes (paper arithmetic, dflash_actors.train.costmodel)", ""]
    rows = []
    for pr in projections:
        for link, v in pr["links"].items():
            rows.append([pr["model"], f"{pr['target_s']} s", f"{pr['drafter_s']} s",
                         f"{pr['drafter_params'] / 1e9:.2f}B",
                         " / ".join(f"{x:g}" for x in pr["bytes_per_batch_gb"].values()),
                         f"{link} ({v['gb_per_s']:g} GB/s)", f"{v['transfer_s']} s", v["overhead_fraction"],
                         *(f"{t['best']} ({t['tokens_per_s']:.0f} tok/s, {t['bottleneck']}-bound)"
                           for t in v["topologies"].values())])
    devices = list(projections[0]["links"].values())[0]["topologies"]
    out += _table(["target shape", "target/batch", "drafter/batch", "drafter params",
                   "GB/batch feat/grad/weights", "link", "transfer/batch", "overhead", *(f"best on {d} GPUs"
                                                                                       for d in devices)], rows)
    a = projections[0]["assumptions"]
    w = a["workload"]
    out += ["", f"Assumptions: {a['tflops']:g} TFLOP/s sustained bf16 per GPU; {w['token_budget']} tokens per "
                f"batch in {w['sequences_per_batch']} sequences; {w['anchors']} anchors x block {w['block_size']} "
                f"per sequence; {w['feature_layers']} feature layers (bf16); {w['drafter_layers']}-layer drafter "
                f"with fp32 gradient sums, loaded and committed per batch; optimizer at "
                f"{a['hbm_bytes_per_s'] / 1e12:g} TB/s HBM; loader never limits (prefetched); grad_accum "
                f"{a['grad_accum']}. Forward+backward = 3x forward; FLOPs = 2 per multiply-add."]
    return out


def _others(benches: dict) -> list[str]:
    rows = []
    d = benches.get("data", {})
    if "error" not in d and d:
        rows.append(["data", f"{d['samples']:,} samples: open {d['open_s']} s (materialize would be "
                             f"{d['materialize_over_open']:.0f}x), assemble {d['assemble_ms_median']} ms/batch "
                             f"({d['naive_over_assemble']:.0f}x faster than naive padding), padding efficiency "
                             f"{d['padding_efficiency']}"])
    c = benches.get("channels", {})
    if "error" not in c and c:
        rows.append(["channels", f"ring {c['ring_gbps']} GB/s vs mp.Queue {c['queue_gbps']} GB/s "
                                 f"({c['ring_over_queue']}x); message round trip {c['msg_roundtrip_us']} us"])
    r = benches.get("restart", {})
    if "error" not in r and r:
        k = r.get("simulated_target_kill", {})
        rows.append(["restart", f"a target killed mid-run at 2-2 (simulated): throughput fell to "
                                f"{k.get('throughput_dip')} of steady, back to >= 90% after {k.get('recovery_s')} s "
                                f"(replacement ready after {k.get('restart_s')} s)"])
    su = benches.get("startup", {})
    if "error" not in su and su:
        big = (f"; a {su['target_bytes'] / 1e9:.1f} GB target restarts in {su['target_restart_shared_s']} s "
               f"with shared weights, {su['target_restart_disk_s']} s reading them from disk "
               f"({su.get('target_restart_disk_warm_s')} s from the page cache)" if "target_bytes" in su else "")
        sp = su.get("fast_restart_split_s") or {}
        parts = (f", detect {sp.get('detect')} + respawn {sp.get('respawn')} + start-up {sp.get('startup')} s"
                 if sp else "")
        rows.append(["startup", f"demo 2-2 launch to first step: spawn {su['spawn_first_step_s']} s, forkserver "
                                f"{su['fast_first_step_s']} s; kill -9 to Ready, median over every role: spawn "
                                f"{su['spawn_restart_s_median']} s, forkserver {su['fast_restart_s_median']} s "
                                f"(max {su['fast_restart_s_max']}{parts}){big}"])
    o = benches.get("objective", {})
    if "error" not in o and o:
        rows.append(["objective", "drafter forward+backward on CPU, per-sequence -> batched: " + "; ".join(
            f"{k} {o[k]['ms_median']['per_sequence']} -> {o[k]['ms_median']['batched']} ms ({o[k]['speedup']}x, "
            f"loss within {o[k]['loss_rel_diff_max']:g})" for k in ("default", "hidden_256"))])
    mp = benches.get("memplan", {})
    if "error" not in mp and mp:
        d8 = mp["drafter_8b"]
        def fullest(r):
            return max(v for k, v in r["need_gib"].items() if k != "cpu")
        rows.append(["memplan", "; ".join(
            f"{r['template'].removesuffix('.yaml')} on {r['gpu_gib']} GB: "
            + (f"micro-batches of {r['drafter_block_tokens']}, fullest GPU {fullest(r):.1f} GiB" if r["exit"] == 0
               else "does not fit") for r in mp["plans"])
            + f"; 8B drafter keeps {d8['plain']['saved_mib_per_block_token']} MiB per block token "
            f"({d8['checkpointed']['saved_mib_per_block_token']} checkpointed), the old whole batch "
            f"{d8['plain']['whole_batch_saved_gib']} GiB"])
    lr = benches.get("learning", {})
    if "error" not in lr and lr:
        rows.append(["learning", f"simulated tau {lr['simulated_tau_untrained']} -> {lr['simulated_tau_trained']}, "
                                 f"real tau {lr['real_tau_trained']} (lossless: {lr['lossless']}), "
                                 f"sim vs real {lr['sim_vs_real']}"])
    def optional(name, describe):
        """The row of a bench that may skip itself (no SmolLM2): its reason, or its result."""
        rec = benches.get(name, {})
        if "skipped" in rec:
            rows.append([name, rec["skipped"]])
        elif "error" not in rec and rec:
            rows.append([name, describe(rec)])

    def real(rr):
        pos = " ".join("-" if x is None else f"{x:.2f}" for x in rr["per_position_trained"])
        return (f"{rr['target']}, {rr['completions']} regenerated completions, "
                f"{rr['train_minutes']} min of training ({rr['train_steps']}/{rr['total_steps']} steps): "
                f"real tau trained {rr['real_tau_trained']} vs untrained {rr['real_tau_untrained']} vs "
                f"{rr['baseline']} baseline {rr['real_tau_baseline']}; simulated tau "
                f"{rr['simulated_tau_trained']}; per-position acceptance {pos}; lossless: {rr['lossless']}"
                + (f"; on {e['prompts']} external prompts {e['real_tau_trained']} vs {e['baseline']} "
                   f"{e['real_tau_baseline']}" if (e := rr.get("external")) else ""))

    optional("real", real)
    optional("generate", lambda g: (
        f"{g['target']}, {g['prompts']} prompts, batch {g['batch_size']}: continuous "
        f"{g['continuous']['tok_s']} tok/s against fixed {g['fixed']['tok_s']} ({g['continuous_over_fixed']}x); "
        f"rows idle {g['continuous']['idle_row_share']:.1%} against {g['fixed']['idle_row_share']:.1%}"))
    optional("serving", lambda sv: (
        f"{sv['server']} ({sv['path']} path, {sv['concurrency']} in flight): {sv['server_tok_s']} tok/s against "
        f"in-process {sv['inprocess_tok_s']}; greedy exact match {sv['greedy_exact_match']}, "
        f"{sv['retokenize_mismatch_rows']} rows re-tokenized unlike the server; "
        f"resume identical: {sv['resume_identical']}"))
    for name, rec in benches.items():
        if "error" in rec:
            rows.append([name, f"FAILED: {rec['error'].splitlines()[-1] if rec['error'] else ''}"])
    return ["", "## Other benches", ""] + _table(["bench", "result"], rows) if rows else []


def render(results: dict) -> str:
    out = [f"# make bench: {results['host']}, {results['at']}, {results['cpus']} CPUs", ""]
    p = results["benches"].get("pipeline", {})
    if "pipeline" in p:
        out += _pipeline(p)
        out += _projection(p["projection"])
        out += ["", f"## Advice (the measured 2-2 stage costs plus {p['control_ms_per_step']} ms/step of measured "
                    "control latency; `launch.py --topology auto` applies the same rule to costs it probes)",
                ""] + [f"- {line}" for line in p["advice"].values()]
        out += [f"- {line}" for line in p.get("advice_target_tp_2", {}).values()]
    c = results["benches"].get("cluster", {})
    if "loopback" in c:
        out += _cluster(c)
    d = results["benches"].get("durability", {})
    if "runs" in d:
        out += _durability(d)
    out += _others(results["benches"])
    return "\n".join(out)


def _cluster(c: dict) -> list[str]:
    out = ["", f"## Across machines: the per-step exchange, {c['nodes']} nodes on loopback ({c['backend']})", ""]
    out += _table(["drafter params", "exchange ms/step", "plain allreduce ms", "exchange GB/s"],
                  [[f"{r['params']:,}", r["exchange_ms_median"], r["allreduce_ms_median"], r["exchange_gb_per_s"]]
                   for r in c["loopback"]])
    for name, est in c["scale_out"].items():
        nodes = list(next(iter(est["links"].values())))
        out += ["", f"### Paper estimate, {est['model']} ({est['drafter_params'] / 1e9:.2f}B drafter params), {name}: "
                    f"{est['node_tokens_per_s']:.0f} tok/s per node ({c['node_split']} on 8 GPUs), "
                    f"{est['step_compute_s']} s of compute per step", ""]
        out += _table(["interconnect", *(f"{k} node(s) tok/s (efficiency)" for k in nodes), "exchange s/step"],
                      [[link, *(f"{v[k]['tokens_per_s']:.0f} ({v[k]['efficiency']})" for k in nodes),
                        v[nodes[-1]]["exchange_s"]] for link, v in est["links"].items()])
    return out


def _durability(d: dict) -> list[str]:
    out = ["", f"## Gradient durability (runtime.grad_durability), 1-1, grad_accum {d['grad_accum']}, simulated "
               f"compute ({d['drafter_ms_per_batch']} ms drafter/batch), a {d['grad_mb']} MB gradient sum", ""]
    rows = []
    for mode in ("batch", "step"):
        clean, kill = d["runs"][f"{mode}_clean"], d["runs"][f"{mode}_kill"]
        g = clean["gradient_ms_per_batch"]
        rows.append([mode, clean["tokens_per_s"], f"{g['gradient load']} + {g['gradient commit']}", kill["recovery_s"],
                     len(kill["redone"] or []), kill["evicted"]])
    out += _table(["durability", "steady tok/s", "gradient load + commit ms/batch",
                   "extra s for the step a drafter died in", "batches redone", "batches evicted"], rows)
    p = d["paper_qwen3_8b"]
    links = [k for k, v in p.items() if isinstance(v, dict)]
    out += ["", f"step / batch throughput: {d['step_over_batch_tokens_per_s']}x; all four runs bit-identical: "
                f"{d['bit_identical']}. Paper arithmetic for a Qwen3-8B drafter ({p['grad_gb']} GB fp32 sum, "
                f"{p['drafter_s_per_batch']} s of drafter compute per batch at 400 TFLOP/s): `batch` moves the sum "
                + "; ".join(f"over {k} in {p[k]['batch_s_per_batch']} s per batch ({p[k]['batch_share']:.1%} of "
                            "the drafter's time)" for k in links)
                + f"; `step` redoes at most {p['step_redo_s_worst']} s of work per drafter death."]
    return out
