"""Translators on the Hugging Face hub: download by repo id, upload with a model card.

A translator repo holds ``translator.safetensors`` and a generated ``README.md``.
Downloads go through huggingface-hub's own cache and honour ``HF_HUB_OFFLINE``.
"""

import json
import re
import tempfile
from pathlib import Path

from .errors import KvlingoError, TranslatorFileError

FILENAME = "translator.safetensors"
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and not text.endswith(".safetensors")


def resolve_translator(path_or_repo) -> Path:
    """A local translator file for a path, or for a hub repo id (downloaded/cached)."""
    p = Path(path_or_repo)
    if p.exists() or not is_repo_id(str(path_or_repo)):
        return p
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(str(path_or_repo), FILENAME))
    except Exception as e:
        raise TranslatorFileError(
            f"Could not get a translator from hub repo {path_or_repo!r} "
            f"({type(e).__name__}: {e}). Offline (HF_HUB_OFFLINE=1) only repos already "
            "in the hub cache work."
        ) from e


def model_card(translator, fidelity: dict = None) -> str:
    """A README.md for a translator repo: the pair, how it was trained, its fidelity."""
    spec = translator.spec
    training = json.dumps(spec.training, indent=2, sort_keys=True)
    lines = [
        "---",
        "library_name: mlx-kvlingo",
        "tags: [mlx, kv-cache, mlx-kvlingo]",
        "---",
        f"# KV-cache translator: {spec.source.name} -> {spec.target.name}",
        "",
        "Translates the KV cache of the source model into one the target model can read, so a "
        "conversation can switch models without re-prefilling ([mlx-kvlingo]"
        "(https://pypi.org/project/mlx-kvlingo/)).",
        "",
        "| | |",
        "|---|---|",
        f"| source | `{spec.source.name}` (geometry {spec.source.fingerprint}) |",
        f"| target | `{spec.target.name}` (geometry {spec.target.fingerprint}) |",
        f"| alignment | {spec.alignment} |",
        f"| native prefix | {spec.native_prefix} |",
        f"| source layers per map | {len(spec.layer_map[0])} |",
        "",
        "## Training",
        "",
        "```json",
        training,
        "```",
    ]
    if fidelity:
        lines += ["", "## Measured fidelity (held-out text)", "",
                  "| context | CBR | KL | top-1 | NLL native | NLL translated | NLL no context |",
                  "|---|---|---|---|---|---|---|"]
        for ctx, f in sorted(fidelity.items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {ctx} | {f['cbr']:.1%} | {f['kl']:.3f} | {f['top1']:.1%} | "
                f"{f['nll_native']:.3f} | {f['nll_translated']:.3f} | {f['nll_none']:.3f} |"
            )
    lines += ["", "## Use", "", "```bash",
              f"mlx-kvlingo switch --source {spec.source.name} --target {spec.target.name} "
              "--translator REPO_ID --prompt '...'", "```", ""]
    return "\n".join(lines)


def push(translator_path, repo_id: str, fidelity: dict = None, private: bool = False, api=None):
    """Upload a translator and its model card to ``repo_id``; returns the commit URL."""
    from huggingface_hub import HfApi

    from .translator import load_translator

    if not is_repo_id(repo_id):
        raise KvlingoError(f"{repo_id!r} is not a hub repo id (OWNER/NAME).")
    translator = load_translator(translator_path)
    api = api or HfApi()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / FILENAME).write_bytes(Path(translator_path).read_bytes())
        (folder / "README.md").write_text(model_card(translator, fidelity))
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, folder_path=str(folder),
                                     commit_message="Upload mlx-kvlingo translator")
        except Exception as e:
            raise KvlingoError(f"Upload to {repo_id} failed ({type(e).__name__}: {e}).") from e
    return getattr(info, "commit_url", str(info))
