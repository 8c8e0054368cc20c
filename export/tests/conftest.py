import pytest
from export_cache_dir import EXPORT_CACHE

from klein_export.convert import convert
from klein_export.quantize import DYNAMIC, STATIC, QuantizationConfig, quantize_copy
from klein_export.tiny import build_tiny


@pytest.fixture(scope="session")
def export_cache():
    return EXPORT_CACHE


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("ckpt") / "klein-tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "klein-tiny"
    return convert(tiny_checkpoint, out, variant="tiny", log=lambda _: None, cache=EXPORT_CACHE)


@pytest.fixture(scope="session")
def fp16_bundle(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "klein-tiny-fp16"
    return convert(tiny_checkpoint, out, variant="tiny", precision="fp16", log=lambda _: None, cache=EXPORT_CACHE)


@pytest.fixture(scope="session")
def int8_bundle(tiny_bundle, tmp_path_factory):
    return quantize_copy(
        tiny_bundle, tmp_path_factory.mktemp("int8") / "klein-tiny-int8", QuantizationConfig(bits=8), log=lambda _: None
    )


@pytest.fixture(scope="session")
def dynamic_bundle(tiny_bundle, tmp_path_factory):
    return quantize_copy(
        tiny_bundle,
        tmp_path_factory.mktemp("dynamic") / "klein-tiny-int8-dynamic",
        QuantizationConfig(bits=8, method=DYNAMIC),
        log=lambda _: None,
    )


@pytest.fixture(scope="session")
def static_bundle(tiny_bundle, tmp_path_factory):
    return quantize_copy(
        tiny_bundle,
        tmp_path_factory.mktemp("static") / "klein-tiny-vae-int8",
        QuantizationConfig(bits=8, method=STATIC, components=("vae_decoder",)),
        log=lambda _: None,
    )


@pytest.fixture(scope="session")
def reduced_bundle(tiny_bundle, tmp_path_factory):
    """`--reduce-range` (7-bit int8 codes): the text encoder and transformer dynamic, then the VAE decoder
    static, as the benchmark's dds bundle is made."""
    root = tmp_path_factory.mktemp("reduced")
    dynamic = quantize_copy(
        tiny_bundle, root / "dynamic", QuantizationConfig(bits=8, method=DYNAMIC, reduce_range=True), log=lambda _: None
    )
    return quantize_copy(
        dynamic,
        root / "klein-tiny-int8-7bit",
        QuantizationConfig(bits=8, method=STATIC, components=("vae_decoder",), reduce_range=True),
        log=lambda _: None,
    )


@pytest.fixture(scope="session")
def int4_bundle(tiny_bundle, tmp_path_factory):
    return quantize_copy(
        tiny_bundle, tmp_path_factory.mktemp("int4") / "klein-tiny-int4", QuantizationConfig(bits=4), log=lambda _: None
    )
