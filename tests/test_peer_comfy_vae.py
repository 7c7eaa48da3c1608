"""The ComfyUI VAE peer benchmark's own checks, on the CPU: a missing ComfyUI checkout, or one
without the Wan VAE modules, is refused before any timing; ComfyUI's modules are built with the
configuration its comfy.sd.VAE gives the released files; the table."""

import sys

import pytest


@pytest.fixture(scope="module")
def peer_vae():
    from wan_enhanced.bench import peer_comfy_vae
    return peer_comfy_vae


def test_a_folder_without_comfyui_is_refused_before_any_timing(peer_vae, tmp_path, capsys):
    code = peer_vae.main(["--comfyui", str(tmp_path), "--out", str(tmp_path / "out"), "--quick"])
    assert code == 2
    assert "not a ComfyUI checkout (no comfy/ldm/wan/model.py)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_comfyui_without_the_wan_vae_is_refused(peer_vae, tmp_path, monkeypatch):
    root = tmp_path / "novae"
    (root / "comfy" / "ldm" / "wan").mkdir(parents=True)
    for package in ("comfy", "comfy/ldm", "comfy/ldm/wan"):
        (root / package / "__init__.py").write_text("")
    (root / "comfy" / "cli_args.py").write_text("class _A:\n    cpu = False\nargs = _A()\n")
    (root / "comfy" / "ldm" / "wan" / "model.py").write_text(
        "class WanModel:\n    def rope_encode(self):\n        pass\n")
    (root / "comfy" / "ops.py").write_text(
        "class disable_weight_init:\n    pass\nclass fp8_ops:\n    pass\n")
    (root / "comfy" / "ldm" / "wan" / "vae.py").write_text("class NotTheVAE:\n    pass\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "comfy" or m.startswith("comfy.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(peer_vae.ComfyCheckoutError, match="vae.py has no WanVAE"):
        peer_vae.import_comfy_vaes(root, cpu=True)
    (root / "comfy" / "ldm" / "wan" / "vae.py").write_text("class WanVAE:\n    pass\n")
    for name in [m for m in sys.modules if m == "comfy" or m.startswith("comfy.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(peer_vae.ComfyCheckoutError, match="vae2_2.py cannot be imported"):
        peer_vae.import_comfy_vaes(root, cpu=True)


def test_comfyui_gets_the_configuration_of_the_released_files(peer_vae):
    """What comfy.sd.VAE builds for the released Wan2.1 and Wan2.2 VAE files (ComfyUI 0.3.64,
    comfy/sd.py), from our constructors' defaults; and the tiny models' widths carried over."""
    common = dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)
    assert peer_vae.comfy_kwargs("vae21", {}) == dict(dim=96, z_dim=16, **common)
    # the 2.2 VAE's decoder width is ComfyUI's default, 256
    assert peer_vae.comfy_kwargs("vae22", {}) == dict(dim=160, z_dim=48, dec_dim=256, **common)
    tiny = peer_vae.comfy_kwargs("vae22", {"dim": 8, "dec_dim": 12, "z_dim": 48})
    assert (tiny["dim"], tiny["dec_dim"], tiny["z_dim"]) == (8, 12, 48)


def test_the_table_names_each_side_and_the_errors(peer_vae):
    run = {"median_ms": 100.0, "peak_allocated_bytes": 2 << 30, "error": None}
    oom = {"median_ms": None, "peak_allocated_bytes": None, "error": "out of memory"}
    data = {"comfyui": "0.3.64", "device": "d", "torch": "t", "date": "x", "repeats": 3,
            "command": "c",
            "rows": [{"case": "vae21_decode", "video": "1280x720x81", "ours": "untiled",
                      "ours_run": {**run, "median_ms": 80.0}, "comfy_run": run,
                      "time_ratio": 0.8, "max_rel_diff": 1e-3},
                     {"case": "vae22_decode", "video": "1280x704x121", "ours": "budget 3 GiB",
                      "ours_run": run, "comfy_run": oom, "time_ratio": None,
                      "max_rel_diff": None}]}
    table = peer_vae.markdown(data)
    assert "| vae21_decode | 1280x720x81 | untiled | 80 | 100 | 0.800 | 2.00 / 2.00 | " \
           "1.00e-03 |" in table
    assert "| vae22_decode | 1280x704x121 | budget 3 GiB | 100 | - | - | 2.00 / - | - |" in table
    assert "- vae22_decode budget 3 GiB: ours None, ComfyUI out of memory" in table
