"""The sampler's step cache: EasyCache, or TeaCache / MagCache with the published table of the
run's model. Checked before anything is placed on the device: an unknown method, a negative
threshold, and a model a method has no published table for are refused by name.

Which table: the released model the file's shapes name (checkpoints/loader.py), an A14B pair
taken as Wan2.2 T2V-A14B or I2V-A14B. Wan2.1 I2V-14B 480P and 720P share one shape: the file
name says which (480p / 720p), else the video size does (up to 832 x 480 pixels: 480P).
Wan2.2 TI2V-5B has two MagCache tables: with a start image and without.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..sampling import magcache, teacache
from ..sampling.magcache_ratios import MAG_RATIOS
from ..sampling.step_cache import CACHE_METHODS, EasyCacheSettings
from ..wan.configs import KNOWN_DITS, vae_spec
from .errors import InputError
from .handles import WanModelHandle

_LOG = logging.getLogger("wan_enhanced")

TEACACHE_RET_STEPS = {"teacache": False, "teacache_ret_steps": True}
_AREA_480P = 832 * 480
_I2V_14B = "wan2.1-i2v-14b"
_TI2V_5B = "wan2.2-ti2v-5b"
_I2V_A14B = "wan2.2-i2v-a14b"

# the tables each method has, by the names table_key gives, in words for the messages
COVERS = {
    "teacache": {"wan2.1-t2v-1.3b": "Wan2.1 T2V-1.3B", "wan2.1-t2v-14b": "Wan2.1 T2V-14B",
                 "wan2.1-i2v-14b-480p": "Wan2.1 I2V-14B 480P",
                 "wan2.1-i2v-14b-720p": "Wan2.1 I2V-14B 720P"},
    "magcache": {"wan2.1-t2v-1.3b": "Wan2.1 T2V-1.3B", "wan2.1-t2v-14b": "Wan2.1 T2V-14B",
                 "wan2.1-i2v-14b-480p": "Wan2.1 I2V-14B 480P",
                 "wan2.1-i2v-14b-720p": "Wan2.1 I2V-14B 720P",
                 "wan2.2-t2v-a14b": "Wan2.2 T2V-A14B (the pair)",
                 "wan2.2-i2v-a14b": "Wan2.2 I2V-A14B (the pair)",
                 "wan2.2-ti2v-5b-t2v": "Wan2.2 TI2V-5B",
                 "wan2.2-ti2v-5b-i2v": "Wan2.2 TI2V-5B"},
}


@dataclass(frozen=True)
class CacheChoice:
    """A run's step cache: the method (CACHE_METHODS), its threshold, and for TeaCache and
    MagCache the published table it uses."""
    method: str
    threshold: float
    table: str | None = None

    @property
    def easycache(self) -> EasyCacheSettings:
        return EasyCacheSettings(threshold=self.threshold)

    def teacache(self) -> teacache.TeaCacheSettings:
        ret_steps = TEACACHE_RET_STEPS[self.method]
        return teacache.TeaCacheSettings(teacache.COEFFICIENTS[self.table][ret_steps],
                                         self.threshold, ret_steps)

    def magcache(self, high_noise_steps: int | None) -> magcache.MagCacheSettings:
        return magcache.MagCacheSettings(
            MAG_RATIOS[self.table], self.threshold, high_noise_steps=high_noise_steps,
            image_to_video=self.table == "wan2.2-i2v-a14b")

    def describe(self) -> str:
        names = {"easycache": "EasyCache", "teacache": "TeaCache",
                 "teacache_ret_steps": "TeaCache (ret steps)", "magcache": "MagCache"}
        table = f", {self.table} table" if self.table else ""
        return f"{names[self.method]} (threshold {self.threshold:g}{table})"


def table_key(model: WanModelHandle, low_noise_model: WanModelHandle | None,
              latent_shape, start_image: bool) -> str:
    """The released model a run's tables are looked up by (see the module docstring)."""
    name = model.config.name
    if low_noise_model is not None:
        return {"wan2.1-t2v-14b": "wan2.2-t2v-a14b"}.get(name, name)
    if name == _I2V_14B:
        file_name = model.name.lower()
        says = [r for r in ("480p", "720p") if r in file_name]
        if len(says) == 1:
            return f"{name}-{says[0]}"
        stride = vae_spec(model.config).spatial_stride
        area = latent_shape[-1] * latent_shape[-2] * stride * stride
        resolution = "480p" if area <= _AREA_480P else "720p"
        _LOG.info("Wan Sampler: %s does not say 480p or 720p in its name; the %d-pixel video "
                  "takes the I2V-14B %s tables", model.name, area, resolution.upper())
        return f"{name}-{resolution}"
    if name == _TI2V_5B:
        return f"{name}-{'i2v' if start_image else 't2v'}"
    if name == _I2V_A14B:  # one expert without the other: no table
        return f"{name}-expert"
    return name


def cache_choice(method: str, threshold: float | None, model: WanModelHandle,
                 low_noise_model: WanModelHandle | None, latent_shape,
                 start_image: bool) -> CacheChoice | None:
    """The run's step cache (None: off), or InputError naming what is wrong."""
    if method not in CACHE_METHODS:
        raise InputError(f"cache: {method!r} is not one of {list(CACHE_METHODS)}")
    if method == "off":
        return None
    if threshold is not None and threshold < 0:
        raise InputError(f"cache_threshold: {threshold} is negative (-1 takes the method's "
                         f"default)")
    if method == "easycache":
        return CacheChoice(method, EasyCacheSettings.threshold if threshold is None
                           else threshold)
    family = "teacache" if method in TEACACHE_RET_STEPS else method
    key = table_key(model, low_noise_model, latent_shape, start_image)
    if key not in COVERS[family]:
        raise InputError(_not_covered(method, family, key, model, low_noise_model))
    if threshold is None:
        threshold = teacache.DEFAULT_THRESHOLD if family == "teacache" else \
            magcache.DEFAULT_THRESHOLD[key.split("-")[0]]
    return CacheChoice(method, threshold, key)


def _not_covered(method: str, family: str, key: str, model: WanModelHandle,
                 low_noise_model: WanModelHandle | None) -> str:
    kind = model.config.name if model.config.name in KNOWN_DITS else \
        "a size no released Wan model has"
    what = f"{model.name} ({kind})" if low_noise_model is None else \
        f"the pair {model.name} + {low_noise_model.name} ({key})"
    covered = sorted(set(COVERS[family].values()))
    others = [m for m in CACHE_METHODS if m not in ("off", method) and
              (m == "easycache" or key in COVERS["teacache" if m in TEACACHE_RET_STEPS else m])]
    single_expert = key == f"{_I2V_A14B}-expert"
    hint = " (an A14B expert alone: give the pair, low_noise_model)" if single_expert else ""
    return (f"cache: {method} has no published table for {what}{hint}; it covers "
            f"{', '.join(covered)}. For this model choose {' or '.join(others)}")
