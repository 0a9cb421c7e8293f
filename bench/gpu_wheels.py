"""The wheels bench/gpu_verify.py needs on the GPU machine, downloaded here into .whl/ (the device tool carries it).

    .venv/bin/python bench/gpu_wheels.py            # then: the device tool's run with carry [".whl"]

The GPU machine's image (/work/.library/device/KINDS.md, read 2026-11-17) has Python 3.12, torch 2.11 (CUDA 13),
accelerate, peft and transformers 5.17, but no deepspeed, datasets, evaluate or bitsandbytes, and reaches no
network. This downloads the versions finetune is tested with (constraints.txt) of what is missing or older there,
then every requirement of theirs the image lacks (their Requires-Dist for Python 3.12 on x86-64 Linux, until
nothing is missing), and checks that each requirement the image does hold is met where the image's version is
known. deepspeed is a source release: built here into a pure-Python wheel (its CUDA ops build on first use
there). bitsandbytes is repacked with its CUDA 13 library only (43 MB -> about 7 MB: a call carries 64 MiB).
Prints what it carries and why; exits 1 when a requirement cannot be met or the folder is over 60 MiB.

On the GPU machine, first in the command:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

# The image's Python packages (KINDS.md, "Python packages already there", 2026-11-17), with the versions a
# session's pip list showed there; None: there, version not read.
IMAGE = dict.fromkeys(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
    cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
    fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
    joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
    mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
    nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
    regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
    tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
    torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
    zipp""".split()
)
IMAGE.update(
    {
        "accelerate": "1.15.0",
        "huggingface-hub": "1.33.0",
        "numpy": "2.5.2",
        "safetensors": "0.8.0",
        "tokenizers": "0.23.2",
        "torch": "2.11.0",
        "transformers": "5.17.0",
        "triton": "3.6.0",
    }
)
WANTED = ("transformers", "peft", "accelerate", "datasets", "evaluate", "deepspeed", "bitsandbytes")
BITSANDBYTES = "bitsandbytes==0.50.2"  # not in constraints.txt (no CPU build); the one gpu_verify ran
KEEP_CUDA = "cuda130"  # the image's torch is cu130
PLATFORM = [
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[
        f"--platform={p}"
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_24_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux1_x86_64",
        )
    ],
]
ENV = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "implementation_name": "cpython",
    "extra": "",
}


def pins() -> dict[str, str]:
    """constraints.txt as {canonical name: 'name==version'}."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            out[canonicalize_name(line.split("==")[0])] = line
    return out


def pip(*args: str, env: dict | None = None) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"pip {' '.join(args)} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")


def download(spec: str, into: Path) -> Path:
    before = set(into.iterdir())
    if canonicalize_name(Requirement(spec).name) == "deepspeed":
        with tempfile.TemporaryDirectory() as tmp:
            pip("download", "--no-deps", "--no-binary", ":all:", "-d", tmp, spec)
            sdist = next(Path(tmp).iterdir())
            env = {**os.environ, "DS_BUILD_OPS": "0"}  # the ops build on the GPU machine when first used
            pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(into), str(sdist), env=env)
    else:
        pip("download", "--no-deps", "--only-binary=:all:", *PLATFORM, "--platform=any", "-d", str(into), spec)
    (new,) = set(into.iterdir()) - before
    return new


def repack_bitsandbytes(wheel: Path) -> Path:
    """The wheel without the CUDA libraries of other CUDA versions (and ROCm, XPU): RECORD follows."""
    drop = re.compile(r"libbitsandbytes_(?!cpu|" + KEEP_CUDA + r")\w+\.so$")
    out = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        kept = [i for i in src.infolist() if not drop.search(i.filename)]
        record = next(i for i in kept if i.filename.endswith(".dist-info/RECORD"))
        for info in kept:
            if info is not record:
                dst.writestr(info, src.read(info))
        lines = [
            line for line in src.read(record).decode().splitlines() if line and not drop.search(line.split(",")[0])
        ]
        dst.writestr(record, "\n".join(lines) + "\n")
    out.replace(wheel)
    return wheel


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENV)]


def wheel_version(wheel: Path) -> Version:
    return Version(wheel.name.split("-")[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(ROOT / ".whl"))
    args = parser.parse_args()
    into = Path(args.dir)
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    if into.parent == ROOT and f"/{into.name}/" not in (exclude.read_text() if exclude.exists() else ""):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with open(exclude, "a") as f:
            f.write(f"/{into.name}/\n")  # carried, never committed
    pinned = {**pins(), "bitsandbytes": BITSANDBYTES}
    carried: dict[str, Path] = {}
    why: dict[str, str] = {}
    todo = [(canonicalize_name(n), "wanted by gpu_verify") for n in WANTED]
    problems = []
    while todo:
        name, reason = todo.pop(0)
        if name in carried:
            continue
        spec = pinned.get(name, name)
        wheel = download(spec, into)
        if name == "bitsandbytes":
            wheel = repack_bitsandbytes(wheel)
        carried[name], why[name] = wheel, reason
        for req in requirements(wheel):
            dep = canonicalize_name(req.name)
            if dep in carried:
                if not req.specifier.contains(wheel_version(carried[dep]), prereleases=True):
                    problems.append(f"{name} needs {req}, carrying {carried[dep].name}")
            elif dep in IMAGE and (IMAGE[dep] is None or req.specifier.contains(IMAGE[dep], prereleases=True)):
                continue  # the image has it (its version unknown, or known and good)
            else:
                had = f" (the image has {IMAGE[dep]})" if dep in IMAGE else ""
                todo.append((dep, f"{name} needs {req}{had}"))
    total = sum(p.stat().st_size for p in into.iterdir())
    for name, wheel in sorted(carried.items()):
        print(f"{wheel.stat().st_size / 2**20:7.1f} MiB  {wheel.name:<70} {why[name]}")
    print(f"{total / 2**20:7.1f} MiB  in {into} ({len(carried)} wheels)")
    if total > 60 * 2**20:
        problems.append(f"{total / 2**20:.1f} MiB is over the 60 MiB this leaves room for (a call carries 64)")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
