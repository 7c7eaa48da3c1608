"""bench/kernel_counters.py (run under ncu on a GPU machine by bench/run_kernel_counters.sh):
its arguments, and a clear refusal without a GPU."""

import pytest
import torch

from wan_enhanced.bench import kernel_counters


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_a_gpu(capsys):
    assert kernel_counters.main(["--shape", "14b"]) == 2
    assert "kernel_counters: no CUDA GPU here" in capsys.readouterr().err


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as caught:
        kernel_counters.main(["--shape", "7b"])
    assert caught.value.code == 2 and "--shape" in capsys.readouterr().err
