"""Writing a file whole: JSON written under a temporary name, then renamed into place.

A kill or a full disk mid-write leaves the file as it was and no partial one beside it. Every JSON
file mixloop writes (config.json, the doctor's reports, the benchmark's results, the compile-mode
cache) goes through `write_json`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from typing import Any, Optional


def write_json(path: str, value: Any, *, sort_keys: bool = False, keep_as: Optional[str] = None) -> str:
    """Writes `value` to `path` as strict JSON (a non-finite float becomes the string "inf", "-inf"
    or "nan"), making its folder if need be; with `keep_as`, the file it replaces is copied to that
    name first. Returns `path`.

    Raises:
      OSError: when a file cannot be written; the file it replaces is left as it was, and no
        partial file stays.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"  # Two processes may write one file at once.
    written = [temporary]
    try:
        with open(temporary, "w") as f:
            json.dump(strict_json(value), f, indent=2, sort_keys=sort_keys, allow_nan=False)
            f.write("\n")
        if keep_as is not None:
            written.append(keep_as)
            shutil.copy2(path, keep_as)
        os.replace(temporary, path)
    except OSError:
        for partial in written:
            with contextlib.suppress(OSError):
                os.remove(partial)
        raise
    return path


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by its string ("inf", "-inf", "nan") and every
    dict key a string: what JSON without NaN holds."""
    if isinstance(value, dict):
        return {str(key): strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
