"""The ComfyUI peer benchmark's own checks, on the CPU: a missing or too old ComfyUI checkout is
refused before any timing, with what was expected; the table and the row bookkeeping."""

import json
import sys

import pytest



@pytest.fixture(scope="module")
def peer_comfy():
    from wan_enhanced.bench import peer_comfy
    return peer_comfy


def test_a_folder_without_comfyui_is_refused_before_any_timing(peer_comfy, tmp_path, capsys):
    code = peer_comfy.main(["--comfyui", str(tmp_path), "--out", str(tmp_path / "out"),
                            "--quick"])
    assert code == 2
    assert "not a ComfyUI checkout (no comfy/ldm/wan/model.py)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_comfyui_without_the_wan_model_api_is_refused_as_too_old(peer_comfy, tmp_path,
                                                                   monkeypatch):
    root = tmp_path / "old"
    (root / "comfy" / "ldm" / "wan").mkdir(parents=True)
    for package in ("comfy", "comfy/ldm", "comfy/ldm/wan"):
        (root / package / "__init__.py").write_text("")
    (root / "comfy" / "cli_args.py").write_text("class _A:\n    cpu = False\nargs = _A()\n")
    (root / "comfy" / "ldm" / "wan" / "model.py").write_text("class WanModel:\n    pass\n")
    (root / "comfy" / "ops.py").write_text("class disable_weight_init:\n    pass\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "comfy" or m.startswith("comfy.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(peer_comfy.ComfyCheckoutError, match="too old.*fp8_ops"):
        peer_comfy.import_comfy(root, cpu=True)


def test_rows_are_replaced_per_case_and_mode(peer_comfy, tmp_path):
    def row(case, mode, ms):
        return {"case": case, "video": "v", "mode": mode, "comfy_mode": mode, "ours_ms": ms,
                "comfy_ms": 2 * ms, "ratio": 0.5, "ours_vs_fp32": {"max_rel": 0.1, "rel_l2": 0.1},
                "comfy_vs_fp32": {"max_rel": 0.2, "rel_l2": 0.2}, "ours_peak_activation_gib": 1,
                "comfy_peak_activation_gib": 1, "ours_error": None, "comfy_error": None}
    meta = {"device": "d", "torch": "t", "comfyui": "c", "repeats": 1, "command": "x"}
    first = [row("dit_5b", "bf16_eager", 1.0), row("dit_5b", "fp8_compiled", 3.0)]
    peer_comfy.save(tmp_path, first, meta, {})
    peer_comfy.save(tmp_path, [row("dit_5b", "bf16_eager", 5.0)], meta, {})
    table = (tmp_path / "peer_comfy.md").read_text()
    assert "| dit_5b v | bf16_eager | 5 | 10 | **0.500** |" in table
    assert "| dit_5b v | fp8_compiled | 3 | 6 |" in table
    # one run saves once per case: its command is recorded once; another run's is added
    peer_comfy.save(tmp_path, [row("dit_1_3b", "bf16_eager", 2.0)], {**meta, "command": "y"}, {})
    saved = json.loads((tmp_path / "peer_comfy.json").read_text())
    assert saved["commands"] == ["x", "y"]
    assert table.startswith("Device: d, torch t, ComfyUI c;")  # saved before Triton was named


def test_the_table_names_the_triton_that_built_our_kernels(peer_comfy, tmp_path):
    """Our Hopper kernels build differently per Triton release, so a result says which one."""
    meta = {"device": "d", "torch": "t", "triton": "3.9.0", "comfyui": "c", "repeats": 1,
            "command": "x"}
    row = {"case": "dit_5b", "video": "v", "mode": "bf16_eager", "comfy_mode": "bf16_eager",
           "ours_ms": 1.0, "comfy_ms": 2.0, "ratio": 0.5,
           "ours_vs_fp32": {"max_rel": 0.1, "rel_l2": 0.1},
           "comfy_vs_fp32": {"max_rel": 0.2, "rel_l2": 0.2}, "ours_peak_activation_gib": 1,
           "comfy_peak_activation_gib": 1, "ours_error": None, "comfy_error": None}
    peer_comfy.save(tmp_path, [row], meta, {})
    assert (tmp_path / "peer_comfy.md").read_text().startswith(
        "Device: d, torch t, Triton 3.9.0, ComfyUI c;")
