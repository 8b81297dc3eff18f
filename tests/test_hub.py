"""Translators on the hub: download from a (pre-populated) hub cache, upload up to the
network call."""

import shutil

import pytest
from tiny import tiny_model

from mlx_kvlingo.errors import KvlingoError, TranslatorFileError
from mlx_kvlingo.translator import hub, publish
from mlx_kvlingo.translator.maps import Translator, load_translator


@pytest.fixture
def translator_file(tmp_path):
    m = tiny_model("qwen3")
    t = Translator.for_models(m, m)
    t.spec.training = {"stage": 1, "corpus": "stdlib"}
    p = tmp_path / "t.safetensors"
    t.save(p)
    return p


def _populate_hub_cache(cache, repo_id, file):
    """The layout huggingface-hub itself writes: refs/main -> snapshots/<commit>/file."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(file, repo / "snapshots" / commit / hub.FILENAME)


def test_load_translator_by_repo_id_from_the_hub_cache(tmp_path, translator_file, monkeypatch):
    import huggingface_hub.constants as c

    cache = tmp_path / "hub"
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    _populate_hub_cache(cache, "someone/tiny-translator", translator_file)
    t = load_translator("someone/tiny-translator")
    assert t.spec.training["corpus"] == "stdlib"
    with pytest.raises(TranslatorFileError, match="someone/missing.*Offline"):
        load_translator("someone/missing")


def test_local_paths_are_not_mistaken_for_repo_ids(tmp_path):
    assert not hub.is_repo_id("dir/file.safetensors")
    assert hub.is_repo_id("owner/name")
    with pytest.raises(TranslatorFileError, match="not found"):
        load_translator(tmp_path / "nope.safetensors")


class FakeApi:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def create_repo(self, repo_id, private, exist_ok):
        self.calls.append(("create_repo", repo_id, private))

    def upload_folder(self, repo_id, folder_path, commit_message):
        import os

        self.files = {f: open(os.path.join(folder_path, f), "rb").read() for f in os.listdir(folder_path)}
        if self.fail:
            raise ConnectionError("no network")
        self.calls.append(("upload_folder", repo_id))
        return type("Info", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()


def test_push_uploads_translator_and_model_card(translator_file):
    api = FakeApi()
    fidelity = {"256": {"cbr": 0.75, "kl": 0.4, "top1": 0.7, "nll_native": 2.9,
                        "nll_translated": 3.2, "nll_none": 4.1}}
    url = publish.push(translator_file, "me/pair", fidelity=fidelity, api=api)
    assert url.endswith("/commit/1")
    assert api.calls[0] == ("create_repo", "me/pair", False)
    assert api.files[hub.FILENAME] == translator_file.read_bytes()
    card = api.files["README.md"].decode()
    assert "tiny-qwen3 -> tiny-qwen3" in card and "75.0%" in card and '"corpus": "stdlib"' in card


def test_push_reports_failures_clearly(translator_file, tmp_path):
    with pytest.raises(KvlingoError, match="Upload to me/pair failed.*no network"):
        publish.push(translator_file, "me/pair", api=FakeApi(fail=True))
    with pytest.raises(KvlingoError, match="not a hub repo id"):
        publish.push(translator_file, "not a repo", api=FakeApi())
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    with pytest.raises(TranslatorFileError):
        publish.push(bad, "me/pair", api=FakeApi())
