"""The example scripts run as they stand on the built-in pair."""

import os
import subprocess
import sys
from pathlib import Path

from mlx_kvlingo.translator.maps import load_translator

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args, stdin=None, env=None):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *map(str, args)],
                          input=stdin, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_chat_app_escalates_to_the_large_model(kv_cache_dir):
    out = run("chat_app.py", stdin="Return the sum of a list.\n/big Open a file.\n"
              "Why does it fail?\nok\n", env={"MLX_KVLINGO_CACHE": str(kv_cache_dir)})
    lines = [line for line in out.splitlines() if line.startswith("  [")]
    models = [line[3:].split(":")[0] for line in lines]
    assert models == ["small", "large", "large", "small"]  # /big, then the "why" rule
    assert "translated 0," in lines[0] and "translated 0," not in lines[1]
    assert "translated 0," not in lines[3]  # small reads large's two turns translated
    assert "4 turns, 2 switches" in out


def test_train_translator_runs_stage_1_and_2(tmp_path):
    out_file = tmp_path / "t.safetensors"
    out = run("train_translator.py", "--out", out_file, "--fit-tokens", "3000", "--steps", "2",
              "--context", "64")
    assert "stage 1:" in out and "stage 2: 2 steps" in out and "training stage 2" in out
    t = load_translator(out_file)
    assert t.spec.training["stage"] == 2
    assert (tmp_path / "t.safetensors.log.jsonl").exists()
