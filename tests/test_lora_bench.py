"""bench/lora_gpu.py --quick on the CPU: every row of the speed table and every step of the
memory table is there, and the rows agree as the modes must (strength 0 is the base model,
unmerged gives the merged output to rounding)."""

import json
from pathlib import Path

import pytest

from wan_enhanced.bench import lora_gpu


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux /proc")
def test_quick_run_measures_every_row(tmp_path):
    out = tmp_path / "out"
    code = lora_gpu.main(["--out", str(out), "--quick", "--repeats", "1", "--cache",
                          str(tmp_path / "cache"), "--config", "bf16:eager",
                          "fp8_e4m3fn_fast:eager"])
    assert code == 0
    data = json.loads((out / "lora_gpu.json").read_text())
    rows = {(r["config"], r["row"]): r for r in data["rows"]}
    assert list(rows) == [(c, row) for c in ("bf16:eager", "fp8_e4m3fn_fast:eager")
                          for row in ("base", "unmerged", "strength 0", "merged")]
    for config, tolerance in (("bf16:eager", 0.01), ("fp8_e4m3fn_fast:eager", 0.05)):
        base, unmerged = rows[(config, "base")], rows[(config, "unmerged")]
        zero, merged = rows[(config, "strength 0")], rows[(config, "merged")]
        assert all(r["run"]["error"] is None and r["ratio_to_base"] > 0
                   for r in (base, unmerged, zero, merged))
        assert unmerged["factor_bytes"] > 0 == zero["factor_bytes"] == merged["factor_bytes"]
        assert zero["weight_bytes"] == base["weight_bytes"] == merged["weight_bytes"]
        assert merged["max_rel_diff_to_merged"] == 0
        assert zero["max_rel_diff_to_merged"] == base["max_rel_diff_to_merged"] > 0.05
        assert unmerged["max_rel_diff_to_merged"] < tolerance
    memory = data["memory"]
    assert [r["kind"] for r in memory["runs"]] == ["load", "merge at load", "merge after"]
    assert all(r["rss_anon_peak"] >= r["rss_anon_before"] > 0 for r in memory["runs"])
    assert memory["largest_matrix_float32_bytes"] == 4 * 512 * 256
    markdown = (out / "lora_gpu.md").read_text()
    assert "| fp8_e4m3fn_fast | eager | unmerged |" in markdown and "| merge after |" in markdown
    assert not list((tmp_path / "cache").glob(".*"))  # the children's result files are gone
