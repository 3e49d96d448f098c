"""``MRopeState.text_position``: the one number a single text token's three M-RoPE streams
share, which the persistent decode buffers hold. It must be what the general ``[3, T]``
positions give for every text slot of a prompt (before, between and after images) and for
every generated token after it."""

from __future__ import annotations

import torch

from epd_engine.model.mrope import MRopeState, mrope_positions

IMAGE = 99


def test_every_text_slot_and_every_generated_token_gets_its_general_position() -> None:
    # text, a 1 x 4 x 4 image (2 x 2 merged), text, a 1 x 2 x 4 image (1 x 2), text
    ids = [1, 2, 3, *[IMAGE] * 4, 4, 5, *[IMAGE] * 2, 6, 7]
    positions, delta = mrope_positions(ids, [(1, 4, 4), (1, 2, 4)], IMAGE, spatial_merge_size=2)
    state = MRopeState(positions, delta)
    assert delta != 0  # images take fewer positions than slots: slots alone would be wrong
    text_slots = [slot for slot, token in enumerate(ids) if token != IMAGE]
    for slot in [*text_slots, *range(len(ids), len(ids) + 5)]:
        general = state.positions(slot, 1)[:, 0]
        assert torch.equal(general, torch.full((3,), general[0])), slot  # a text token
        assert state.text_position(slot) == int(general[0]), slot
