"""Publishing a translator to the Hugging Face hub: its file and a model card."""

import json
from pathlib import Path

from ..errors import KvlingoError
from .hub import FILENAME, is_repo_id, upload
from .maps import load_translator


def model_card(spec, fidelity: dict = None) -> str:
    """A README.md for a translator repo: the pair, how it was trained, its fidelity."""
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
    """Upload a translator and its model card to ``repo_id``; returns the commit URL.
    The file is read and checked first, so a damaged one is never uploaded."""
    if not is_repo_id(repo_id):
        raise KvlingoError(f"{repo_id!r} is not a hub repo id (OWNER/NAME).")
    translator = load_translator(translator_path)
    files = {FILENAME: Path(translator_path).read_bytes(),
             "README.md": model_card(translator.spec, fidelity)}
    return upload(repo_id, files, private=private, api=api)
