"""Where the test suite finds assets that are fetched rather than committed.

`scripts/fetch_test_assets.sh` puts them under `<repo>/.cache/assets/` (git-ignored); CI runs it before pytest.
A test that needs a missing asset is skipped with the command that fetches it.

Offers: ASSETS_DIR, qwen3_tokenizer_dir.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = REPO_ROOT / ".cache" / "assets"
FETCH_COMMAND = "scripts/fetch_test_assets.sh"


def _asset_dir(name: str, required: tuple[str, ...]) -> Path:
    folder = ASSETS_DIR / name
    missing = [f for f in required if not (folder / f).is_file()]
    if missing:
        pytest.skip(f"test asset {folder} lacks {', '.join(missing)}; fetch it with: {FETCH_COMMAND}")
    return folder


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json), or skip the test."""
    return _asset_dir("qwen3-tokenizer", ("tokenizer.json", "tokenizer_config.json"))
