"""The environment: versions, devices, free ``/dev/shm`` and ``/tmp``.
"""

from __future__ import annotations

import contextlib
import shutil
import sys

from .common import emit, error_line, gib


def bench_env(out: str | None = None) -> dict:
    import importlib.util

    result = {"section": "env", "python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "pyarrow", "psutil", "yaml", "safetensors", "pynvml", "tensorboard"):
        result[mod] = importlib.util.find_spec(mod) is not None
    try:
        import torch
        import transformers

        n = torch.cuda.device_count()
        result.update(torch=torch.__version__, transformers=transformers.__version__,
                      cuda=torch.cuda.is_available(), devices=[torch.cuda.get_device_name(i) for i in range(n)],
                      device_memory_gib=[gib(torch.cuda.get_device_properties(i).total_memory) for i in range(n)])
    except Exception as e:  # noqa: BLE001 - recorded; the sections that need torch fail on their own
        result["error"] = error_line(e)
    for name, path in (("shm_free_gb", "/dev/shm"), ("tmp_free_gb", "/tmp")):
        with contextlib.suppress(OSError):
            result[name] = round(shutil.disk_usage(path).free / 2 ** 30, 1)
    emit(result, out)
    return result
