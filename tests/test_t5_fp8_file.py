"""ComfyUI's scaled-fp8 umT5 file (umt5_xxl_fp8_e4m3fn_scaled layout: fp8 block matrices, each
with a per-tensor `scale_weight`): its matrices stay fp8 in memory and are dequantized per
matmul, computing exactly what the file dequantized on load computes, in half the bytes."""

import torch
from safetensors.torch import save_file

from wan_enhanced.checkpoints import tiny
from wan_enhanced.checkpoints.loader import load_text_encoder
from wan_enhanced.quant import Fp8Linear
from wan_enhanced.wan.t5 import is_block_matrix, wan_key_to_hf


def _write(path, state, fp8: bool):
    """The tiny encoder in ComfyUI's layout; block matrices as fp8 codes with a per-tensor
    scale, or (fp8=False) as the float32 values those codes stand for."""
    out = {}
    for key, value in state.items():
        name = wan_key_to_hf(key)
        if is_block_matrix(key):
            scale = value.abs().amax().float() / 448
            codes = (value.float() / scale).to(torch.float8_e4m3fn)
            if fp8:
                out[name] = codes
                out[name[:-len("weight")] + "scale_weight"] = scale.reshape(())
            else:
                out[name] = codes.float() * scale
        else:
            out[name] = value.float()
    out["encoder.embed_tokens.weight"] = out["shared.weight"].clone()
    save_file(out, str(path))
    return path


def test_scaled_fp8_file_keeps_fp8_weights_and_computes_the_dequantized_model(tmp_path):
    state = tiny.random_t5_state(tiny.TINY_T5, seed=4)
    kept, _, info = load_text_encoder(_write(tmp_path / "fp8.safetensors", state, True),
                                      torch.float32)
    plain, _, _ = load_text_encoder(_write(tmp_path / "f32.safetensors", state, False),
                                    torch.float32)
    layers = [m for m in kept.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 7 * tiny.TINY_T5.num_layers  # q, k, v, o, gate, fc1, fc2
    assert all(m.weight.dtype == torch.float8_e4m3fn and not m.fast for m in layers)
    assert "kept as stored" in info.quantization_detail

    def matrix_bytes(model):
        return sum(p.nbytes for n, p in model.named_parameters()
                   if is_block_matrix(n) or n.endswith("weight_scale"))
    assert matrix_bytes(kept) * 3 < matrix_bytes(plain)  # 1 byte (+ scales) against 4

    ids = torch.randint(0, tiny.TINY_T5.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        assert torch.equal(kept(ids, mask), plain(ids, mask))


def test_a_bf16_file_loads_plain_layers(tmp_path):
    path = tiny.write_text_encoder(tmp_path / "bf16.safetensors", "hf", tiny.TINY_T5)
    model, _, _ = load_text_encoder(path, torch.bfloat16)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert model.blocks[0].attn.q.weight.dtype == torch.bfloat16


def test_the_token_table_keeps_a_narrower_stored_dtype_with_the_same_outputs(tmp_path):
    """A bf16 file in a float32 encoder: the 256k x 4096 token table (2 GiB in bf16) stays bf16,
    the looked-up rows are widened, and the outputs equal those of a table widened on load."""
    path = tiny.write_text_encoder(tmp_path / "bf16.safetensors", "hf", tiny.TINY_T5)
    model, _, _ = load_text_encoder(path, torch.float32)
    assert model.token_embedding.weight.dtype == torch.bfloat16
    assert model.blocks[0].attn.q.weight.dtype == torch.float32
    ids = torch.randint(0, tiny.TINY_T5.vocab_size, (2, 9))
    with torch.no_grad():
        out = model(ids)
        model.token_embedding.weight.data = model.token_embedding.weight.float()
        assert out.dtype == torch.float32 and torch.equal(out, model(ids))
    # a float32 file in a bf16 encoder is narrowed as asked
    wide = tiny.write_text_encoder(tmp_path / "f32.safetensors", "hf", tiny.TINY_T5,
                                   dtype=torch.float32)
    narrow, _, _ = load_text_encoder(wide, torch.bfloat16)
    assert narrow.token_embedding.weight.dtype == torch.bfloat16


def test_auto_computes_an_fp8_file_in_float32_also_on_a_gpu(tmp_path, monkeypatch):
    """A half-precision umT5 can drift far from float32 (its attention scores are not divided
    by sqrt(d)): with auto, an fp8 file's weights stay fp8 and dequantize to float32 wherever
    the encoder runs; a bf16 file on a GPU computes in bf16, and an explicit dtype is kept."""
    from wan_enhanced import host
    from wan_enhanced.pipeline.loading import load_text_encoder_handle

    monkeypatch.setattr(host, "compute_device", lambda: torch.device("cuda"))
    state = tiny.random_t5_state(tiny.TINY_T5, seed=4)
    fp8 = _write(tmp_path / "fp8.safetensors", state, True)
    bf16 = tiny.write_text_encoder(tmp_path / "bf16.safetensors", "hf", tiny.TINY_T5)
    monkeypatch.setattr("wan_enhanced.pipeline.loading.find_tokenizer", lambda path, spiece: None)

    def computes_in(path, dtype):
        model = load_text_encoder_handle(path, dtype, "gpu").model
        fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        return model.norm.weight.dtype, {m.compute_dtype for m in fp8_layers}

    assert computes_in(fp8, "auto") == (torch.float32, {torch.float32})
    assert computes_in(fp8, "bf16") == (torch.bfloat16, {torch.bfloat16})
    assert computes_in(bf16, "auto") == (torch.bfloat16, set())


def test_fp16_computes_an_fp8_file_like_the_dequantized_file(tmp_path):
    """In float16 the FFN's output projection runs in float32: for an fp8 file from its
    dequantized weight (the codes alone are off by the tensor's scale)."""
    state = tiny.random_t5_state(tiny.TINY_T5, seed=4)
    kept, _, _ = load_text_encoder(_write(tmp_path / "fp8.safetensors", state, True),
                                   torch.float16)
    plain, _, _ = load_text_encoder(_write(tmp_path / "f32.safetensors", state, False),
                                    torch.float16)
    exact, _, _ = load_text_encoder(tmp_path / "f32.safetensors", torch.float32)
    ids = torch.randint(0, tiny.TINY_T5.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = exact(ids)
        for model in (kept, plain):
            out = model(ids)
            assert float((out - reference).abs().max() / reference.abs().max()) < 1e-2
