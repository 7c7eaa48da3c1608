"""bench/multi_gpu.py --quick on gloo CPU processes: its rows, its comparison with the one-GPU
output and its per-rank metrics (the real run needs 2 or 4 GPUs: bench/run_multi_gpu.sh)."""

import json

import torch

from wan_enhanced.bench import multi_gpu
from wan_enhanced.wan.dit import WanDiT

from test_sharded_blocks import held_with_sharded_blocks


def test_quick_run(tmp_path):
    assert multi_gpu.main(["--quick", "--out", str(tmp_path), "--gpus", "1,2",
                           "--repeats", "2"]) == 0
    report = json.loads((tmp_path / "multi_gpu.json").read_text())
    rows = report["rows"]
    assert [(r["gpus"], r["fsdp"], r["status"]) for r in rows] == [
        (1, False, "ok"), (2, False, "ok"), (2, True, "ok")]
    assert [r["mode"] for r in rows] == ["single", "ulysses", "ulysses"]  # 4 heads over 2
    for row in rows:
        assert row["relative_difference"] < 1e-6  # float32: the split equals one process
        assert len(row["seconds"]) == 2 and row["speedup"] > 0
        assert [m["rank"] for m in row["ranks"]] == list(range(row["gpus"]))
    assert rows[1]["ranks"][0]["all_to_all_bytes_per_forward"] > 0
    assert "fsdp_overhead" in rows[2] and "fsdp_overhead" not in rows[1]
    whole, shard = rows[1]["ranks"][0]["weight_bytes"], rows[2]["ranks"][0]["weight_bytes"]
    with torch.device("meta"):
        model = WanDiT(multi_gpu.QUICK, compute_dtype=torch.float32)
    assert whole == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert shard == held_with_sharded_blocks(model, whole, world=2)
    # on the CPU the chunks are ordinary (allocator) memory: nothing held outside it
    assert [m["outside_allocator_bytes"] for m in rows[2]["ranks"]] == [0, 0]
    assert [m["fsdp_fill"] for m in rows[2]["ranks"]] == ["all-gathers"] * 2
    assert rows[1]["ranks"][0]["fsdp_fill"] is None
    assert report["environment"] == {"NCCL_NVLS_ENABLE": "0",
                                     "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    table = (tmp_path / "multi_gpu.md").read_text()
    assert table.count("| ok |") == 3 and "| 2 | on (all-gathers) | ulysses |" in table


def test_plan_and_refusals(tmp_path, capsys):
    assert multi_gpu.plan([1, 2, 4], "both") == [(1, False), (2, False), (2, True),
                                                 (4, False), (4, True)]
    assert multi_gpu.plan([2], "on") == [(1, False), (2, True)]
    if not multi_gpu.torch.cuda.is_available():
        assert multi_gpu.main(["--out", str(tmp_path)]) == 2
        assert "no CUDA GPU here" in capsys.readouterr().err
    assert multi_gpu.main(["--quick", "--out", str(tmp_path), "--gpus", "1,99"]) == 2
    assert "--gpus 99 asked for" in capsys.readouterr().err


def test_inputs_have_the_latent_of_the_video():
    config = multi_gpu.KNOWN_DITS["wan2.1-t2v-14b"].config
    case = multi_gpu.inputs(config, "832x480x33", quick=False)
    assert tuple(case.x.shape) == (1, 16, 9, 60, 104) and case.context.shape == (1, 512, 4096)


def test_rows_are_written_as_they_come(tmp_path, monkeypatch):
    """A run cut short (a stop, a time limit) keeps every row it finished, with its comparison."""
    real = multi_gpu.run_row
    done = []

    def run_row(*args, **kwargs):
        if len(done) == 2:
            raise KeyboardInterrupt  # the third row never finishes
        done.append(real(*args, **kwargs))
        return done[-1]

    monkeypatch.setattr(multi_gpu, "run_row", run_row)
    try:
        multi_gpu.main(["--quick", "--out", str(tmp_path), "--gpus", "1,2", "--repeats", "1"])
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the third row should have been cut short")
    rows = json.loads((tmp_path / "multi_gpu.json").read_text())["rows"]
    assert [(r["gpus"], r["fsdp"]) for r in rows] == [(1, False), (2, False)]
    assert rows[1]["relative_difference"] < 1e-6 and "output" not in rows[1]
    assert (tmp_path / "multi_gpu.md").read_text().count("| ok |") == 2


def test_profiled_rows(tmp_path):
    """--profile: every rank reports the operators of one more forward, which the timing and the
    communication counters leave out."""
    assert multi_gpu.main(["--quick", "--out", str(tmp_path), "--gpus", "1,2", "--fsdp", "off",
                           "--repeats", "1", "--profile"]) == 0
    rows = json.loads((tmp_path / "multi_gpu.json").read_text())["rows"]
    plain = tmp_path / "plain"
    assert multi_gpu.main(["--quick", "--out", str(plain), "--gpus", "1,2", "--fsdp", "off",
                           "--repeats", "1"]) == 0
    unprofiled = json.loads((plain / "multi_gpu.json").read_text())["rows"]
    for row, other in zip(rows, unprofiled):
        assert len(row["seconds"]) == 1
        for rank, same in zip(row["ranks"], other["ranks"]):
            assert rank["forwards"] == same["forwards"] == 2  # the warm-up and the timed one
            assert rank["all_to_all_calls"] == same["all_to_all_calls"]
            assert rank["all_to_all_bytes"] == same["all_to_all_bytes"]
            names = [k["name"] for k in rank["kernels"]]
            assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names
            assert all(k["ms"] > 0 and k["calls"] > 0 for k in rank["kernels"])
            assert rank["kernels_summed_ms"] >= sum(k["ms"] for k in rank["kernels"]) - 1e-9
            assert "kernels" not in same
    assert rows[1]["ranks"][0]["all_to_all_calls"] == 2 * 2 * multi_gpu.QUICK.num_layers
    table = (tmp_path / "kernels.md").read_text()
    assert table.count("## ") == 2 and "## 2 GPU(s), fsdp off" in table
    assert not (plain / "kernels.md").exists()
