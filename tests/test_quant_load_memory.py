"""bench/quant_load_memory.py --quick: a smoke test of the quantize-on-load memory benchmark."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "quant_load_memory.py"
SCHEMES = ["bf16", "fp8_e4m3fn", "int8"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux /proc")
def test_quick_run_reports_every_scheme(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--cache", str(tmp_path / "cache"),
         "--quick", "--scheme", *SCHEMES],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]

    data = json.loads((out / "quant_load_memory.json").read_text())
    assert [row["weight_dtype"] for row in data["rows"]] == SCHEMES
    for row in data["rows"]:
        assert row["final_model_bytes"] > 0
        assert row["peak_rss_anon_over_baseline"] > 0
        assert row["peak_vmhwm_over_baseline"] > 0
        assert row["seconds"] > 0
        assert row["ratio_to_final_model"] > 0
    rows = {row["weight_dtype"]: row for row in data["rows"]}
    assert rows["bf16"]["quantization"] is None
    for name in ("fp8_e4m3fn", "int8"):
        assert rows[name]["quantization"] == name
        # codes are one byte per weight, the bf16 model two
        assert rows[name]["final_model_bytes"] < rows["bf16"]["final_model_bytes"]
    assert data["machine"]["torch"] and data["machine"]["cpu_count"]
    markdown = (out / "quant_load_memory.md").read_text()
    assert all(f"| {name} |" in markdown for name in SCHEMES)
    assert not list(out.glob(".*"))  # the children's result files are gone
    assert (tmp_path / "cache").is_dir()  # a --cache folder is kept for the next run
