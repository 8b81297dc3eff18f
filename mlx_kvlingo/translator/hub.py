"""Translators on the Hugging Face hub: download by repo id, upload with a model card.

A translator repo holds ``translator.safetensors`` and a generated ``README.md``.
Downloads go through huggingface-hub's own cache and honour ``HF_HUB_OFFLINE``.
"""

import re
import tempfile
from pathlib import Path

from ..errors import KvlingoError, TranslatorFileError

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


def upload(repo_id: str, files: dict, private: bool = False, api=None) -> str:
    """Upload ``files`` (name -> bytes or text) to ``repo_id`` in one commit; returns
    the commit URL."""
    from huggingface_hub import HfApi

    if not is_repo_id(repo_id):
        raise KvlingoError(f"{repo_id!r} is not a hub repo id (OWNER/NAME).")
    api = api or HfApi()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            (folder / name).write_bytes(data)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            info = api.upload_folder(repo_id=repo_id, folder_path=str(folder),
                                     commit_message="Upload mlx-kvlingo translator")
        except Exception as e:
            raise KvlingoError(f"Upload to {repo_id} failed ({type(e).__name__}: {e}).") from e
    return getattr(info, "commit_url", str(info))
