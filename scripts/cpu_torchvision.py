"""torchvision's Python transforms for vLLM's CPU build, so its vision-language models run on a CPU test machine.

Run with the interpreter of that environment (`make vllm-env`). vLLM's Qwen-VL modules import transformers' Qwen2-VL
image processor, which imports `torchvision.transforms.v2.functional` at module level. The registry's torchvision is a
CUDA build: its native library needs libtorch_cuda, which CPU torch lacks, and `import torchvision` then fails
("operator torchvision::nms does not exist"). This installs that wheel (the version paired with the environment's
torch) without its native libraries and makes the two fake-kernel registrations that need them conditional, as the
others in the same file already are. What remains is torchvision's pure-Python part; its C++ operators (nms, roi_align,
image decoding) are absent, and vLLM's Qwen-VL processors use none of them. A test-environment measure only: a GPU
environment has the real torchvision.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PAIRED = {"2.13": "0.28.0"}  # torch minor -> torchvision release built against it
GUARDED = 'torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f)'


def main() -> None:
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if minor not in PAIRED:
        sys.exit(f"cpu_torchvision: no torchvision known for torch {torch.__version__}; add it to PAIRED")
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "--quiet"]
        subprocess.run([*pip, "download", "--no-deps", "-d", tmp, f"torchvision=={PAIRED[minor]}"], check=True)
        subprocess.run([*pip, "install", "--no-deps", "--force-reinstall", *map(str, Path(tmp).glob("*.whl"))],
                       check=True)  # fmt: skip
    spec = importlib.util.find_spec("torchvision")
    assert spec is not None and spec.origin is not None
    package = Path(spec.origin).parent
    for native in [*package.glob("*.so"), package.parent / "torchvision.libs"]:
        if native.is_dir():
            shutil.rmtree(native)
        elif native.exists():
            native.unlink()
    registrations = package / "_meta_registrations.py"
    text = registrations.read_text()
    for op in ("nms", "qnms"):
        plain = f'@torch.library.register_fake("torchvision::{op}")'
        if plain not in text:
            sys.exit(f"cpu_torchvision: {registrations} has no {plain}; this torchvision is not the one expected")
        text = text.replace(plain, "@(" + GUARDED.format(op=op) + ")")
    registrations.write_text(text)
    check = "from torchvision.transforms.v2 import functional; import vllm.model_executor.models.qwen2_vl"
    subprocess.run([sys.executable, "-c", check], check=True, stdout=subprocess.DEVNULL)
    print(f"cpu_torchvision: torchvision {PAIRED[minor]} (Python part) in {package}")


if __name__ == "__main__":
    main()
