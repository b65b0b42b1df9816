"""LTX-2 with sound compiles each layer whole: the state its layers pass (av_layers.AVState) is
read and written without a graph break. `dataclasses.fields` on the class broke the graph, and
the code after the break recompiled at every call (LTX-2.3 with sound: 8x the time per clip of
video alone on an H100, 2,162 host syncs per step)."""

from __future__ import annotations

import torch

from dpipe.models.ltx_video.ltx2.av_layers import AVState


def _state(prompt: bool) -> tuple[torch.Tensor, ...]:
    count = 17 if prompt else 15
    return tuple(torch.full((2, 3), float(i)) for i in range(count))


def test_the_layers_state_unpacks_and_packs_in_one_graph():
    for prompt in (False, True):
        def roundtrip(inputs):
            s = AVState.unpack(inputs, prompt)
            s.hidden = s.hidden * 2
            return s.pack()

        inputs = _state(prompt)
        compiled = torch.compile(roundtrip, backend="eager", fullgraph=True)
        got = compiled(inputs)
        assert len(got) == len(inputs)
        torch.testing.assert_close(got[0], inputs[0] * 2)
        for a, b in zip(got[1:], inputs[1:]):
            torch.testing.assert_close(a, b)
