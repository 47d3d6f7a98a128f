"""Refusing a model.pt2 whose loading would run pickled code.

`torch.export.load` unpickles some payloads of the archive with `weights_only=False`: weights or constants marked
`use_pickle`, custom and opaque objects, and any `.pt` payload (the sample inputs a saved program carries, legacy
state dicts) that `weights_only=True` cannot read — torch then retries without it. An artifact is a file somebody
handed over (its manifest checksums can be rewritten along with it), so loading one must never execute code.
fxllm's own archives hold plain tensors only: every such payload reads with `weights_only=True`.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

from fxllm.errors import ArtifactError

TENSOR_PAYLOAD_PREFIXES = ("weight_", "tensor_")  # torch's names for raw tensor bytes (no pickle)
PICKLED_OBJECT_MARKERS = ("custom_obj_", "opaque_obj_")


def check_no_pickled_code(torch, path: Path) -> None:
    """ArtifactError unless every payload of the archive at `path` loads without unpickling arbitrary objects."""
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                _check_entry(torch, archive, name, path.name)
    except zipfile.BadZipFile as exc:
        raise ArtifactError(f"'{path.name}' is not a torch.export archive: {exc}") from None


def _check_entry(torch, archive: zipfile.ZipFile, name: str, file: str) -> None:
    refuse = f"'{file}' holds a pickled object ({name}); loading it could run arbitrary code, so it is refused"
    if any(marker in name.rsplit("/", 1)[-1] for marker in PICKLED_OBJECT_MARKERS):
        raise ArtifactError(refuse)
    if name.endswith(("_weights_config.json", "_constants_config.json")):
        try:
            entries = json.loads(archive.read(name)).get("config", {})
        except (ValueError, AttributeError) as exc:
            raise ArtifactError(f"'{file}' has an unreadable payload table {name}: {exc}") from None
        for fqn, meta in entries.items():
            if not isinstance(meta, dict) or meta.get("use_pickle") is not False or \
                    not str(meta.get("path_name", "")).startswith(TENSOR_PAYLOAD_PREFIXES):
                raise ArtifactError(f"'{file}' stores '{fqn}' as a pickle ({name}); loading it could run arbitrary "
                                    "code, so it is refused")
    elif name.endswith(".pt"):
        try:
            torch.load(io.BytesIO(archive.read(name)), weights_only=True)
        except Exception:  # noqa: BLE001 - whatever weights_only refuses, torch would unpickle without it
            raise ArtifactError(refuse) from None
