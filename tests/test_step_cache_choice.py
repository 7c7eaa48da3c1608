"""Which published table a run's TeaCache or MagCache takes (pipeline/step_caches.py), each
method's default threshold, and refusals that name the model and the methods covering it."""

from types import SimpleNamespace

import pytest

from wan_enhanced.pipeline.errors import InputError
from wan_enhanced.pipeline.step_caches import cache_choice
from wan_enhanced.wan.configs import KNOWN_DITS

LATENT_480P = (1, 16, 21, 60, 104)  # 832 x 480 pixels
LATENT_720P = (1, 16, 21, 90, 160)


def handle(known: str, file_name: str = "model.safetensors"):
    return SimpleNamespace(name=file_name, config=KNOWN_DITS[known].config)


def choose(method, model, low=None, latent=LATENT_480P, start_image=False, threshold=None):
    return cache_choice(method, threshold, model, low, latent, start_image)


def test_each_model_takes_its_table_and_default_threshold():
    t2v14 = handle("wan2.1-t2v-14b")
    assert choose("teacache", t2v14) == \
        choose("teacache", t2v14, threshold=0.2)  # the reference script's default
    assert choose("teacache_ret_steps", handle("wan2.1-t2v-1.3b")).table == "wan2.1-t2v-1.3b"
    assert choose("magcache", t2v14).threshold == 0.12  # MagCache4Wan2.1's default
    pair = choose("magcache", t2v14, low=handle("wan2.1-t2v-14b"))
    assert (pair.table, pair.threshold) == ("wan2.2-t2v-a14b", 0.04)  # MagCache4Wan2.2's
    i2v_pair = handle("wan2.2-i2v-a14b")
    assert choose("magcache", i2v_pair, low=i2v_pair).table == "wan2.2-i2v-a14b"
    ti2v = handle("wan2.2-ti2v-5b")
    assert choose("magcache", ti2v).table == "wan2.2-ti2v-5b-t2v"
    assert choose("magcache", ti2v, start_image=True).table == "wan2.2-ti2v-5b-i2v"
    assert choose("easycache", t2v14).threshold == 0.2 and choose("off", t2v14) is None
    assert choose("magcache", t2v14, threshold=0.3).threshold == 0.3


def test_the_i2v_14b_file_name_or_else_the_video_size_picks_480p_or_720p():
    def table(file_name, latent):
        return choose("teacache", handle("wan2.1-i2v-14b", file_name), latent=latent).table

    assert table("wan2.1_i2v_480p_14B_fp16.safetensors", LATENT_720P) == "wan2.1-i2v-14b-480p"
    assert table("Wan2_1-I2V-14B-720P_fp8.safetensors", LATENT_480P) == "wan2.1-i2v-14b-720p"
    assert table("i2v.safetensors", LATENT_480P) == "wan2.1-i2v-14b-480p"
    assert table("i2v.safetensors", LATENT_720P) == "wan2.1-i2v-14b-720p"


def test_models_without_a_table_are_refused_naming_who_covers_them():
    ti2v = handle("wan2.2-ti2v-5b", "ti2v.safetensors")
    with pytest.raises(InputError, match=r"^cache: teacache has no published table for "
                       r"ti2v.safetensors \(wan2.2-ti2v-5b\); it covers Wan2.1 I2V-14B 480P, "
                       r"Wan2.1 I2V-14B 720P, Wan2.1 T2V-1.3B, Wan2.1 T2V-14B. For this model "
                       r"choose easycache or magcache$"):
        choose("teacache", ti2v)
    high, low = handle("wan2.1-t2v-14b", "high.safetensors"), handle("wan2.1-t2v-14b", "low")
    with pytest.raises(InputError, match=r"teacache has no published table for the pair "
                       r"high.safetensors \+ low \(wan2.2-t2v-a14b\).* choose easycache or "
                       r"magcache$"):
        choose("teacache", high, low=low)
    with pytest.raises(InputError, match=r"magcache has no published table for "
                       r"e.safetensors \(wan2.2-i2v-a14b\) \(an A14B expert alone: give the "
                       r"pair, low_noise_model\).* choose easycache$"):
        choose("magcache", handle("wan2.2-i2v-a14b", "e.safetensors"))
    with pytest.raises(InputError, match=r"magcache has no published table .*flf2v"):
        choose("magcache", handle("wan2.1-flf2v-14b"))
    with pytest.raises(InputError, match=r"^cache: 'fastcache' is not one of \['off', "):
        choose("fastcache", ti2v)
