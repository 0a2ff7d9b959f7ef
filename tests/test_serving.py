"""The serving artefact: GemModel's KV-cached ranking through torch.export and an AOTInductor package (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.config import GemConfig
from model.gem import GemModel
from model.serving import RankingModule, export_ranking, fixed_request, request_tensors


def _setup():
    cfg = dataclasses.replace(GemConfig.tiny(), num_hstu_layers=1, max_num_candidates=4, contextual_len=2,
                              num_time_buckets=8)
    model = GemModel(cfg, "fused").eval()
    with torch.no_grad():
        for p in model.sequence_arch.layers[0].bias.parameters():
            p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    request = fixed_request(cfg, 10, 4)
    with torch.no_grad():
        expected = model(request)
    return model, request, expected


def test_ranking_module_exports_with_the_same_scores():
    model, request, expected = _setup()
    example = request_tensors(request, 0)
    module = RankingModule(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(module(*example), expected, atol=1e-5, rtol=1e-5)
        program = torch.export.export(module, example)
        torch.testing.assert_close(program.module()(*example), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # AOTInductor compiles C++: ~4.5 min on the busy 2-core dev machine
def test_aoti_package_gives_the_same_scores(tmp_path):
    model, request, expected = _setup()
    example = request_tensors(request, 0)
    path = export_ranking(model, example, 2, str(tmp_path / "rank.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    torch.testing.assert_close(runner(*example), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("argv, flag", [(["--history", "-1"], "--history"), (["--candidates", "0"], "--candidates"),
                                        (["--microbatch", "0"], "--microbatch"), (["--seed", "-2"], "--seed"),
                                        (["--out", "/proc/rank.pt2"], "--out")])
def test_cli_refuses_bad_values_before_building(argv, flag, capsys, monkeypatch):
    """`python -m model.serving` with a negative history, no candidates, an empty micro-batch, a negative
    seed or an unwritable package path: a usage error naming the flag, before any model is built
    (it gave torch's "negative dimension", wrote a package of zero candidates, or failed mid-run)."""
    import model.serving as serving

    monkeypatch.setattr(serving, "GemModel", lambda *a, **k: pytest.fail("built a model for bad arguments"))
    with pytest.raises(SystemExit) as exc:
        serving.main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
