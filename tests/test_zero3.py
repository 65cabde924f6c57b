"""Fully sharded parameters (ZeRO-3, ``OverlapConfig(shard_params=True)``).

One 4-rank gloo spawn (EP 2 x DP 2, ``zero3_cases.everything``; CI's slow step) serves the distributed tests:
two optimizer steps against eager + manual reduction (with and without ``delay_wgrad``, chunks,
user AC), the parameter memory per rank, a DCP checkpoint and resume, forward-only on the
sharded model, and the named errors; a second one the edge cases (``zero3_cases.edge``). The
default suite checks the units, the roles and the placement of the gather/drop nodes
single-process, on a program built from a capture (the ``shard`` pass needs no process group).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

import fxoverlap
import zero3_cases
from fxoverlap.ir.program import program_of, reshard, unshard, wait_unshard
from fxoverlap.models import MoEConfig, MoETransformer
from fxoverlap.passes.capture import capture
from fxoverlap.passes.reduce import parameter_roles
from fxoverlap.passes.schedule import schedule
from fxoverlap.passes.shard import ShardError, param_units, shard
from fxoverlap.passes.split import split
from fxoverlap.passes.tag import tag
from fxoverlap.testing import run_distributed


@functools.cache
def _everything() -> list[dict]:
    return run_distributed(zero3_cases.everything, world_size=4)


CASES = [zero3_cases.case_name(*c) for c in zero3_cases.TRAIN]


def _train(case: str) -> list[dict]:
    return [out["train"][case] for out in _everything()]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_steps_equal_eager_with_manual_reduction(case):
    """Expert gradients bitwise (they sum over 2 ranks), dense ones within 1e-6 * max|p| (the
    reduce-scatter sums over 4 ranks in gloo's order), parameters after SGD the same."""
    for rank, row in enumerate(_train(case)):
        assert row["types"] == ["DTensor"], (rank, row["types"])
        for step, diff in enumerate(row["grad_diff"]):
            assert diff["missing"] == [], (rank, step, diff)
            assert diff["expert"] == 0.0, (rank, step, diff)
            assert diff["dense"] <= 1e-6 * row["scale"], (rank, step, diff)
        assert max(row["param_diff"]) <= 1e-6 * row["scale"], (rank, row["param_diff"])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_gather_runs_ahead_of_its_reader_and_is_dropped_once(case):
    row = _train(case)[0]["placement"]
    assert row["bad"] == []
    # the program's first gather has nothing before it; every other one at least one stage
    assert row["ahead"][0] == 0 and min(row["ahead"][1:]) >= 1, row["ahead"]
    assert all(gathers == drops for gathers, drops in row["per_unit"].values()), row["per_unit"]
    if "keep=inf" in case:  # each unit gathered once per step
        assert {g for g, _ in row["per_unit"].values()} == {1}, row["per_unit"]
        assert row["peak"] == len(row["units"]), row
    else:  # 1F1B: a forward and a backward layer's units in use, and one gather ahead
        assert 2 <= row["peak"] <= 5, row["peak"]
        assert max(g for g, _ in row["per_unit"].values()) > 1, row["per_unit"]


@pytest.mark.slow
def test_parameter_memory_per_rank():
    """Between steps a rank holds P/n (dense over 4, experts over 2 ranks); in a step at most the
    gathered units the program's bound allows; each drop frees its unit (nothing else holds it)."""
    for rank, out in enumerate(_everything()):
        m = out["memory"]
        assert m["held"] == m["expected"] < m["full"] / 2, (rank, m)
        assert m["largest_unit"] <= m["peak_gathered"] <= m["bound"], (rank, m)
        assert m["kept_alive"] == [], (rank, m["kept_alive"])
        assert m["gathers"] == m["drops"] > 0 and m["live_after"] == 0, (rank, m)


@pytest.mark.slow
def test_checkpoint_resume_and_forward_only():
    for rank, out in enumerate(_everything()):
        c = out["checkpoint"]
        assert c["state_dict_types"] == ["DTensor"], (rank, c)
        assert c["state_dict_vs_eager"] == 0.0, (rank, c)
        assert c["resumed_bitwise"] and c["resumed_vs_eager"] == 0.0 == c["uninterrupted_vs_eager"], (rank, c)
        assert c["expert_global_shape"][0] == 8, c  # every EP rank's experts: 4 local x EP 2
        assert c["forward_only"] <= 1e-6 * c["eval_scale"], (rank, c)


@pytest.mark.slow
def test_accumulation_over_calls_and_hooks():
    for rank, out in enumerate(_everything()):
        a = out["accumulation"]
        assert a["diff"] <= 1e-6 * a["scale"], (rank, a)
        assert a["hook"] is not None and a["hook"].startswith("ShardParamsError") and "register_hook" in a["hook"], a


@pytest.mark.slow
def test_errors_name_the_problem():
    e = _everything()[0]["errors"]
    assert e["no_dp_group"].startswith("GradReduceConfigError") and "dp_group" in e["no_dp_group"]
    assert "fully_shard" in e["fully_shard"] and "layers.0" in e["fully_shard"]
    assert e["not_divisible"].startswith("ShardError") and "odd [3] over 4 ranks" in e["not_divisible"]
    assert e["optimizer_stepped_before"].startswith("ShardParamsError") and "SGD" in e["optimizer_stepped_before"]


def test_one_rank_world_shards_and_refuses_assigned_full_tensors():
    """World of one rank: sharded all the same (DTensors over one-rank meshes, one gather per
    unit use), two steps bitwise eager's; a full state dict loaded with ``assign=True`` is
    refused by name at the next step."""
    (out,) = run_distributed(zero3_cases.one_rank, world_size=1)
    assert set(out["types"].values()) == {"DTensor"}
    assert out["gathers"] > 0
    assert all(d["expert"] == d["dense"] == 0.0 and not d["missing"] and not d["extra"]
               for d in out["grad_diff"]), out["grad_diff"]
    assert all(p == 0.0 for p in out["param_diff"]), out["param_diff"]
    assert out["assign_error"].startswith("ShardParamsError") and "assign=True" in out["assign_error"]
    assert re.search(r"fxoverlap: \S+ is a plain Parameter of shape \[\d+", out["assign_error"]), out["assign_error"]


# ---------------------------------------------------------------- single process: the pass


def _capture(ac: bool = False):
    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32, activation_checkpoint=ac)
    model = MoETransformer(cfg)
    cap = capture(model, (torch.randint(0, cfg.vocab_size, (2, 16)), torch.randint(0, cfg.vocab_size, (2, 16))))
    return model, cap


def _program(n: int = 3, static: bool = True, keep: float = 0, ahead: int = 1):
    _, cap = _capture()
    gm = tag(cap)
    stages = split(gm, cap.num_layers, static=frozenset(cap.static_placeholders) if static else None)
    units = param_units(cap, {"dense": 2, "expert": 2})
    return cap, stages, units, shard(schedule(stages, cap, n), stages, cap, units, keep_gathered_bytes=keep,
                                     unshard_ahead=ahead)


def test_units_follow_layers_and_roles():
    cap, _, units, _ = _program()
    assert [u.name for u in units] == ["embed", "l0_dense", "l0_expert", "l1_dense", "l1_expert", "head"]
    roles = parameter_roles(cap)
    for u in units:
        assert {roles[p.fqn] for p in u.params} == {u.role}
        assert all(p.offset % 64 == 0 for p in u.params)
    assert {p.fqn for u in units for p in u.params} == set(cap.param_placeholders.values())


def test_roles_of_replayed_experts_under_activation_checkpointing():
    """An experts op replayed in a recompute stage still reads expert weights: the roles (and
    so the group each gradient reduces over) are those without AC."""
    from fxoverlap.passes.recompute import recompute

    _, cap = _capture(ac=True)
    recompute(tag(cap), cap.num_layers)
    roles = parameter_roles(cap)
    assert {k for k, v in roles.items() if v == "expert"} == {
        f"layers.{i}.moe.experts.w{j}" for i in (0, 1) for j in (1, 2, 3)}


def test_no_stage_reads_a_value_made_of_a_parameter_from_another_stage():
    cap, stages, _, _ = _program()
    static = cap.static_placeholders
    made = {o: s.name for s in stages for o in s.outputs}
    for s in stages:
        for node in s.graph_module.graph.find_nodes(op="placeholder"):
            if node.name in made:
                producer = next(st for st in stages if st.name == made[node.name])
                src = next(n for n in producer.graph_module.graph.nodes if n.name == node.name)
                assert not (src.op == "call_function" and all(
                    i.op == "placeholder" and i.name in static for i in src.all_input_nodes)), (s.name, node.name)


def _gathers(program) -> int:
    return sum(1 for n in program.graph.nodes if n.target is unshard)


@pytest.mark.parametrize("keep,ahead", [(0, 1), (1, 1), ("half", 1), (float("inf"), 1), (0, 2)])
def test_placement_snapshot_invariants(keep, ahead):
    """Every reader of a unit's parameters runs between its wait and its drop; each gather is
    issued at least one stage before its wait (the program's first excepted); with a
    ``keep_gathered_mb`` budget too (bytes here: 1 byte keeps only what costs no extra peak)."""
    if keep == "half":
        keep = sum(u.nbytes for u in _program()[2]) / 2
    cap, _, units, program = _program(keep=keep, ahead=ahead)
    placeholder = {fqn: ph for ph, fqn in cap.param_placeholders.items()}
    ph_unit = {placeholder[p.fqn]: u.index for u in units for p in u.params}
    gathered, issued, stages_since = set(), {}, 0
    first = True
    for node in program.graph.nodes:
        if node.target is unshard:
            assert node.args[0] not in issued and node.args[0] not in gathered
            issued[node.args[0]] = stages_since
        elif node.target is wait_unshard:
            u = node.args[0]
            assert stages_since - issued.pop(u) >= (0 if first else 1), node.name
            first = False
            gathered.add(u)
        elif node.target is reshard:
            gathered.remove(node.args[0])
        elif node.op == "call_module":
            stages_since += 1
            step = node.meta["fxoverlap_step"]
            needed = {ph_unit[v] for v in step.reads if v in ph_unit}
            assert needed <= gathered, (node.name, needed - gathered)
    assert not gathered and not issued
    assert program_of(program).gathered_peak <= (5 if keep < float("inf") and ahead == 1 else len(units))
    from fxoverlap.passes.manager import format_plan

    assert format_plan(program).endswith(f"at most {program_of(program).gathered_peak} of 6 parameter units gathered")


def test_keep_gathered_budget_trades_gathers_for_memory():
    """A larger budget never gathers more, never holds more than the budget (or the placement's
    own peak); no budget: every unit once per microbatch and direction at most; unbounded: each
    unit once per step."""
    cap, stages, units, base = _program()
    total = sum(u.nbytes for u in units)
    base_peak = program_of(base).gathered_peak_bytes
    assert max(u.nbytes for u in units) <= base_peak < total
    rows = []
    for keep in sorted((0, 1, base_peak * 1.25, total / 1.2, total * 2, float("inf"))):
        program = shard(schedule(stages, cap, 3), stages, cap, units, keep_gathered_bytes=keep)
        rows.append((keep, _gathers(program), program_of(program).gathered_peak_bytes))
    assert rows[0][1] == _gathers(base) <= len(units) * 3 * 2
    for (keep, gathers, peak), (_, more, _) in zip(rows[1:], rows):
        assert gathers <= more, rows
        assert peak <= max(keep, base_peak), rows
    assert rows[1][2] == base_peak and rows[1][1] < rows[0][1], rows  # merges that cost no peak
    assert rows[-1][1] == rows[-2][1] == len(units) and rows[-1][2] == total, rows
    assert rows[1][1] > rows[3][1] > len(units), rows  # in between: some gaps kept, not all


def test_unshard_ahead_issues_gathers_earlier():
    """``unshard_ahead=2``: gathers run under more stages before their wait than with 1 (and
    each still at least one, the program's first two readers' excepted); the program gathers
    no more often."""
    def stages_ahead(program) -> list[int]:
        issued, since, out = {}, 0, []
        for node in program.graph.nodes:
            if node.target is unshard:
                issued[node.args[0]] = since
            elif node.target is wait_unshard:
                out.append(since - issued.pop(node.args[0]))
            elif node.op == "call_module":
                since += 1
        return out

    cap, stages, units, one = _program()
    two = shard(schedule(stages, cap, 3), stages, cap, units, unshard_ahead=2)
    a1, a2 = stages_ahead(one), stages_ahead(two)
    assert sum(a2) / len(a2) > sum(a1) / len(a1) + 0.5, (a1, a2)
    assert _gathers(two) <= _gathers(one)
    assert program_of(two).gathered_peak > program_of(one).gathered_peak


def test_param_units_refuse_undivisible_parameters():
    _, cap = _capture()
    with pytest.raises(ShardError, match=r"over 3 ranks"):
        param_units(cap, {"dense": 3})


def test_config_refuses_cuda_graphs_autotune_and_front_ends():
    with pytest.raises(fxoverlap.ConfigError, match="cuda_graphs"):
        fxoverlap.OverlapConfig(shard_params=True, cuda_graphs=True)
    with pytest.raises(fxoverlap.ConfigError, match="autotune"):
        fxoverlap.OverlapConfig(shard_params=True, autotune=True)
    with pytest.raises(fxoverlap.ConfigError, match="keep_gathered_mb.*needs shard_params=True"):
        fxoverlap.OverlapConfig(keep_gathered_mb=100)
    with pytest.raises(fxoverlap.ConfigError, match="keep_gathered_mb must be >= 0"):
        fxoverlap.OverlapConfig(shard_params=True, keep_gathered_mb=-1)
    with pytest.raises(fxoverlap.ConfigError, match="unshard_ahead must be an int >= 1"):
        fxoverlap.OverlapConfig(shard_params=True, unshard_ahead=0)
    with pytest.raises(fxoverlap.ConfigError, match="unshard_ahead.*needs shard_params=True"):
        fxoverlap.OverlapConfig(unshard_ahead=2)
    from fxoverlap.config import refused_fields

    assert "shard_params" in refused_fields(fxoverlap.OverlapConfig(shard_params=True), "backend")


@pytest.mark.slow
def test_hugging_face_qwen3_moe_matches_the_unsharded_reduction():
    pytest.importorskip("transformers")
    for rank, out in enumerate(run_distributed(zero3_cases.hugging_face, "qwen3_moe", world_size=4)):
        assert out["missing"] == [], (rank, out["missing"])
        assert out["zero3_losses"] == out["all_reduce_losses"], (rank, out)
        assert out["diff"] <= 1e-6 * out["scale"], (rank, out["diff"], out["scale"])
        roles = {role for _, role, _ in out["units"]}
        assert roles == {"dense", "expert"}, out["units"]


# ---------------------------------------------------------------- edge cases: one slow 4-rank spawn


@functools.cache
def _edge() -> list[dict]:
    return run_distributed(zero3_cases.edge, world_size=4)


def _steps_ok(row: dict, rel: float = 1e-6, experts_bitwise: bool = True) -> None:
    assert "error" not in row, row.get("tb")
    for step, diff in enumerate(row["grad_diff"]):
        assert diff["missing"] == [] == diff["extra"], (step, diff)
        if experts_bitwise and step == 0:
            assert diff["expert"] == 0.0, (step, diff)
        assert diff["expert"] <= rel * row["scale"] and diff["dense"] <= rel * row["scale"], (step, diff)
    assert max(row["param_diff"]) <= rel * row["scale"], row["param_diff"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tied", "frozen", "eval_train", "autocast", "ep1_dp4", "ep4"])
def test_edge_cases_equal_eager_with_manual_reduction(case):
    """Tied embed/head weights (one unit 'embed+head'), a parameter frozen from the start and
    two frozen after a step (captured anew with the sharded model), eval forward between train
    steps, autocast(bf16) on CPU, EP 1 x DP 4 and EP 4 (experts over a group of one: not gathered,
    DTensors over the EP mesh read in place)."""
    for rank, out in enumerate(_edge()):
        _steps_ok(out[case])
    row = _edge()[0][case]
    if case == "tied":
        assert row["units"][0][:2] == ("embed+head", "dense"), row["units"]
        assert row["units"][0][2] == ["tok_embeddings.weight"] and row["still_tied"], row["units"]
        assert row["state_dict_keys"] == [] and row["state_dict_vs_eager"] <= 1e-6 * row["scale"], row
    if case == "eval_train":
        assert row["eval_diff"] == [0.0], row["eval_diff"]
    if case == "ep4":
        assert {r for _, r, _ in row["units"]} == {"dense"}, row["units"]
        # experts no other rank holds: DTensors over the EP mesh all the same, read in place
        assert {t for k, t in row["types"].items() if ".experts." in k} == {"DTensor"}, row["types"]


@pytest.mark.slow
def test_edge_tied_weights_under_all_reduce():
    """The unsharded reduction of a tied weight: both slots' averages reach p.grad (one was dropped)."""
    for out in _edge():
        _steps_ok(out["tied_all_reduce"], experts_bitwise=False)


@pytest.mark.slow
def test_edge_bf16_model_reduces_in_bf16():
    """A bf16 model: bf16 units; the bf16 reduce-scatter against an fp32 reduction of the same
    local gradients, within one bf16 ulp of the gradient scale."""
    for out in _edge():
        row = out["bf16"]
        assert "error" not in row, row.get("tb")
        assert row["unit_dtypes"] == ["torch.bfloat16"]
        for step, diff in enumerate(row["grad_diff"]):
            assert diff["missing"] == [] == diff["extra"], diff
            ulp = 2.0 ** -7 * row["grad_scale"][step]
            assert diff["expert"] <= ulp and diff["dense"] <= ulp, (step, diff, ulp)


@pytest.mark.slow
def test_edge_clip_grad_norm():
    for out in _edge():
        for name, row in out["clip"].items():
            assert abs(row["got"] - row["want"]) <= 1e-6 * row["want"], (name, row)
            assert row["clipped_diff"] <= 1e-6 * row["grad_scale"], (name, row)
        assert "same mesh" in out["clip"]["ep2"]["torch"], out["clip"]["ep2"]
        # one parameter type everywhere: a foreach optimizer steps (EP 4's experts are DTensors too)
        assert out["clip"]["ep2"]["foreach"] is None and out["clip"]["ep4"]["foreach"] is None, out["clip"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral", "gpt_oss"])
def test_edge_hugging_face_families_match_the_unsharded_reduction(family):
    pytest.importorskip("transformers")
    for rank, out in enumerate(_edge()):
        row = out[f"hf_{family}"]
        assert "error" not in row, row.get("tb")
        assert row["missing"] == [] and row["zero3_losses"] == row["all_reduce_losses"], (rank, row)
        assert row["diff"] <= 1e-6 * row["scale"], (rank, row["diff"], row["scale"])
        assert {role for _, role, _ in row["units"]} == {"dense", "expert"}, row["units"]


def test_a_random_draw_made_from_a_parameter_is_not_drawn_again_where_read():
    """split copies a value made of parameters alone into each stage that reads it, but never a
    random draw (``rand_like(w)``): eager draws it once, and the stages must too."""
    from fxoverlap.ir.meta import draws_random_numbers

    class WeightNoise(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens, labels):
            w = self.model.norm.weight
            return self.model(tokens, labels) + (torch.rand_like(w) * w).sum()

    torch.manual_seed(0)
    cfg = MoEConfig.tiny(shared_expert_dim=32)
    batch = (torch.randint(0, cfg.vocab_size, (2, 16)), torch.randint(0, cfg.vocab_size, (2, 16)))
    cap = capture(WeightNoise(MoETransformer(cfg)), batch)
    gm = tag(cap)
    drawn = sum(1 for n in gm.graph.nodes if draws_random_numbers(n))
    assert drawn >= 1
    stages = split(gm, cap.num_layers, static=frozenset(cap.static_placeholders))
    in_stages = sum(1 for s in stages for n in s.graph_module.graph.nodes if draws_random_numbers(n))
    assert in_stages == drawn, (in_stages, drawn)
