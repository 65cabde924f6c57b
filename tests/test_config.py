"""OverlapConfig's field metadata: the phase each field affects and the front ends that refuse it."""

from __future__ import annotations

import dataclasses

import fxoverlap
from fxoverlap.config import BACKEND, OPTIMIZE, PHASES, PIPELINE, field_phase, refused_fields


def test_every_field_states_its_phase_and_refusals_name_known_front_ends():
    for f in dataclasses.fields(fxoverlap.OverlapConfig):
        assert field_phase(f.name) in PHASES, f.name
        assert set(f.metadata["refused_by"]) <= {BACKEND, PIPELINE}, f.name
        assert all(reason for reason in f.metadata["refused_by"].values()), f.name


def test_refused_fields_are_the_ones_set_away_from_their_defaults():
    cfg = fxoverlap.OverlapConfig(compiler="eager", record_memory=True, expert_wgrad_slot=3, grad_reduce="reduce_scatter")
    assert refused_fields(fxoverlap.OverlapConfig(), BACKEND) == {}
    assert refused_fields(cfg, OPTIMIZE) == {}
    assert set(refused_fields(cfg, BACKEND)) == {"record_memory", "expert_wgrad_slot", "grad_reduce"}
    assert set(refused_fields(cfg, PIPELINE, honoured={"grad_reduce"})) == {"record_memory", "expert_wgrad_slot"}
    assert "merged steps" in refused_fields(cfg, BACKEND)["expert_wgrad_slot"]
