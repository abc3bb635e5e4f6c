"""bench/bench_hub.py's dry run on the CPU (--tiny, the demo model's shapes): every engine builds, each section runs,
and the JSON holds each layout's ratios against q4 (the GPU run's numbers are the lead's to take)."""

import json

from bench import bench_hub


def test_tiny_dry_run_writes_every_section(tmp_path, capsys):
    out = tmp_path / "hub.json"
    bench_hub.main(["--tiny", "--reps", "1", "--layouts", "int4,modelopt-nvfp4", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["source"] == "in-memory" and res["layouts"] == ["int4", "modelopt-nvfp4"]
    for kind, experts in (("q4", "q4"), ("int4", "ct-int4->q4"), ("modelopt-nvfp4", "mo-nvfp4->nvfp4e")):
        assert experts in res[kind]["formats"]
        assert res[kind]["step_1k"]["ms"] > 0 and res[kind]["batch8_1k"]["B"] == 2
        assert res[kind]["session_8k"] == {"skipped": "cpu"}
    for kind in ("int4", "modelopt-nvfp4"):
        assert res["ratios"][kind]["step_ratio"] > 0 and res["ratios"][kind]["batch8_ratio"] > 0
    assert "| modelopt-nvfp4 |" in capsys.readouterr().out


def test_unknown_layout_is_an_argument_error(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_hub.main(["--tiny", "--layouts", "int4,gguf"])
    assert "--layouts 'int4,gguf'" in capsys.readouterr().err
